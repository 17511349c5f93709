"""The three remote backends: S3 (s3fs), GCS (gcsfs) and a local/shared filesystem."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import google_crc32c

from . import crc
from .remote import Remote, RemoteError, parts, read_part


class FileRemote(Remote):
    """``file:///path``: a local or shared (NFS, Lustre) directory."""

    scheme = "file"

    async def check(self) -> None:
        """The directory must exist (or be creatable) and be writable."""
        await asyncio.to_thread(os.makedirs, self.root, exist_ok=True)
        if not os.access(self.root, os.W_OK):
            raise PermissionError(f"{self.root} is not writable")

    async def put_bytes(self, key: str, data: bytes) -> None:
        """Write via a temporary name, fsync, rename: readers never see a partial object."""
        await asyncio.to_thread(self._write_atomic, key, [data])

    def _write_atomic(self, key: str, chunks: list[bytes]) -> None:
        final = Path(self.path(key))
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.{secrets.token_hex(4)}.tmp")
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
        fd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    async def put_file(self, local: Path, key: str, size: int, crc32c: int) -> None:
        """Copy part by part (O_DIRECT reads), checking the bytes read against ``crc32c``."""
        final = Path(self.path(key))
        await asyncio.to_thread(final.parent.mkdir, parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.{secrets.token_hex(4)}.tmp")
        fd = await asyncio.to_thread(os.open, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            pieces = []
            for offset, length in parts(size, self.part_size):
                async with self.buffers.buffer() as buf:
                    n, part_crc = await asyncio.to_thread(read_part, local, offset, length, buf)
                    await asyncio.to_thread(os.pwrite, fd, memoryview(buf)[:n], offset)
                pieces.append((part_crc, n))
            got = crc.combine_all(pieces)
            if got != crc32c:
                raise self.mismatch(key, "copied", got, crc32c)
            await asyncio.to_thread(os.fsync, fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        await asyncio.to_thread(os.rename, tmp, final)

    async def native_crc32c(self, key: str) -> int | None:
        """A filesystem keeps no checksum; computed by reading the file."""
        data = await asyncio.to_thread(Path(self.path(key)).read_bytes)
        return int(google_crc32c.value(data))

    def tree_staging(self, tree: str, records: str, node: str) -> str:
        """Under ckptd's records of the step: Orbax reads any local step directory
        without a tmp suffix as finished, so the tree appears by one rename."""
        return f"{records}/{node}/tree"

    async def publish_tree(self, staging: str, tree: str) -> None:
        """Rename the uploaded tree into place (fsynced first)."""
        await asyncio.to_thread(self._publish, Path(self.path(staging)), Path(self.path(tree)))

    def _publish(self, src: Path, dst: Path) -> None:
        if not src.is_dir():
            raise RemoteError(f"{src} vanished before it was published", transient=True)
        # put_file fsynced each file before its rename; the directory entries remain.
        for d, _, _ in os.walk(src):
            _fsync_path(Path(d), os.O_RDONLY | os.O_DIRECTORY)
        if dst.exists():
            # An earlier attempt published it and died before its marker: swap.
            old = src.with_name(f"replaced-{secrets.token_hex(4)}")
            os.rename(dst, old)
            os.rename(src, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(src, dst)
        _fsync_path(dst.parent, os.O_RDONLY | os.O_DIRECTORY)

    async def retract_tree(self, tree: str, records: str, node: str) -> None:
        """Move the tree out of view in one rename, then delete it."""
        src = Path(self.path(tree))
        gone = Path(self.path(f"{records}/{node}/deleting-{secrets.token_hex(4)}"))

        def retract() -> None:
            if not src.exists():
                return
            gone.parent.mkdir(parents=True, exist_ok=True)
            os.rename(src, gone)
            _fsync_path(src.parent, os.O_RDONLY | os.O_DIRECTORY)
            shutil.rmtree(gone, ignore_errors=True)

        await asyncio.to_thread(retract)


def _fsync_path(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class GCSRemote(Remote):
    """``gs://bucket/prefix`` through gcsfs; the object's native crc32c is checked."""

    scheme = "gs"

    async def put_bytes(self, key: str, data: bytes) -> None:
        """A simple upload, then the object's crc32c must match."""
        await self.fs._pipe_file(self.path(key), data)
        want = int(google_crc32c.value(data))
        got = await self.native_crc32c(key)
        if got != want:
            raise self.mismatch(key, "stored", got or 0, want)

    async def put_file(self, local: Path, key: str, size: int, crc32c: int) -> None:
        """A resumable upload (sequential chunks: GCS has no parallel parts), then check crc32c."""
        await self.fs._put_file(str(local), self.path(key), chunksize=self.part_size)
        got = await self.native_crc32c(key)
        if got != crc32c:
            raise self.mismatch(key, "stored", got or 0, crc32c)

    async def native_crc32c(self, key: str) -> int | None:
        """GCS keeps a crc32c of every object (base64, big-endian)."""
        self.fs.invalidate_cache(self.path(key))
        info = await self.fs._info(self.path(key))
        value = info.get("crc32c")
        return crc.from_base64(value) if value else None


def open_remote(url: str, endpoint_url: str, part_size: int, concurrency: int) -> Remote:
    """The backend for a remote URL (its library imported lazily: they are extras)."""
    parsed = urlparse(url)
    root = (parsed.netloc + parsed.path).strip("/")
    if parsed.scheme == "file":
        return FileRemote(url, _local_fs(), "/" + parsed.path.strip("/"), part_size, concurrency)
    if parsed.scheme == "gs":
        # gcsfs.core's class, not the package's default: that one probes every bucket for
        # the zonal/HNS features over gRPC first (60 s per call against an emulator).
        from gcsfs.core import GCSFileSystem

        kwargs: dict[str, Any] = {"asynchronous": True, "skip_instance_cache": True}
        emulator = endpoint_url or os.environ.get("STORAGE_EMULATOR_HOST", "")
        if emulator:
            kwargs.update(endpoint_url=emulator, token="anon")
        return GCSRemote(url, GCSFileSystem(**kwargs), root, part_size, concurrency)
    if parsed.scheme == "s3":
        from .remote_s3 import S3Remote, s3_filesystem

        return S3Remote(url, s3_filesystem(endpoint_url), root, part_size, concurrency)
    raise RemoteError(f"unsupported remote URL {url!r}", transient=False)


def _local_fs() -> Any:
    from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
    from fsspec.implementations.local import LocalFileSystem

    return AsyncFileSystemWrapper(LocalFileSystem())
