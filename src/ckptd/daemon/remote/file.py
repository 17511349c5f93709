"""The ``file://`` backend: a local or shared (NFS, Lustre) directory as the remote tier."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from pathlib import Path
from urllib.parse import urlparse

from ckptd.core import checksum

from ..commit import Commit, RenameCommit
from ..files import fsync_dir, replace_synced
from .base import Remote, read_part
from .buffers import parts
from .layout import COMMIT_FILE


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
        final = Path(self.path(key))
        await asyncio.to_thread(final.parent.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(replace_synced, final, data, 0o644)

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
            got = checksum.combine_all(pieces)
            if got != crc32c:
                raise self.mismatch(key, "copied", got, crc32c)
            await asyncio.to_thread(os.fsync, fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        await asyncio.to_thread(os.rename, tmp, final)

    conditional_writes = True
    """A versioned object is a directory of numbered generations, each created with
    ``link`` (fails if the name exists: O_EXCL's guarantee, also on NFS): replacing
    generation N means creating N+1, which only one writer can."""

    async def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """The newest generation's bytes and its number."""
        return await asyncio.to_thread(_read_newest, Path(self.path(key)))

    async def write_if(self, key: str, data: bytes, version: str | None) -> str | None:
        """Create generation ``version + 1`` (1 when ``version`` is None) exclusively."""
        return await asyncio.to_thread(_write_next, Path(self.path(key)), data, version)

    async def native_crc32c(self, key: str) -> int | None:
        """A filesystem keeps no checksum: computed by reading the file (streamed)."""
        return await asyncio.to_thread(checksum.of_file, Path(self.path(key)))

    def tree_commit(self, tree: str, records: str, node: str) -> Commit:
        """Built under ckptd's records of the step and renamed into place whole: Orbax
        reads any local step directory without a tmp suffix as finished."""
        staging = f"{records}/{node}/tree"
        return RenameCommit(
            Path(self.path(tree)),
            Path(self.path(staging)),
            COMMIT_FILE,
            replace=True,
            location=staging,
            marker_mode=0o644,  # like every other object put here
        )

    async def retract_tree(self, tree: str, records: str, node: str) -> None:
        """Move the tree out of view in one rename, then delete it."""
        src = Path(self.path(tree))
        gone = Path(self.path(f"{records}/{node}/deleting-{secrets.token_hex(4)}"))

        def retract() -> None:
            if not src.exists():
                return
            gone.parent.mkdir(parents=True, exist_ok=True)
            os.rename(src, gone)
            fsync_dir(src.parent)
            shutil.rmtree(gone, ignore_errors=True)

        await asyncio.to_thread(retract)

    @classmethod
    def open(cls, url: str, endpoint_url: str, part_size: int, concurrency: int) -> FileRemote:
        """A ``file:///path`` remote (fsspec's local filesystem, wrapped async)."""
        from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
        from fsspec.implementations.local import LocalFileSystem

        path = "/" + urlparse(url).path.strip("/")
        return cls(url, AsyncFileSystemWrapper(LocalFileSystem()), path, part_size, concurrency)


def _generations(folder: Path) -> list[int]:
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit())


def _read_newest(folder: Path) -> tuple[bytes, str] | None:
    while True:
        gens = _generations(folder)
        if not gens:
            return None
        try:
            return (folder / f"{gens[-1]:020d}").read_bytes(), str(gens[-1])
        except FileNotFoundError:
            continue  # replaced and cleaned up between the listing and the read: again


def _write_next(folder: Path, data: bytes, version: str | None) -> str | None:
    gen = int(version) + 1 if version is not None else 1
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    mine = folder / f"{gen:020d}"
    try:
        os.link(tmp, mine)
    except FileExistsError:
        return None
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(folder)
    gens = _generations(folder)
    # Older generations are removed once replaced, so a writer holding a stale version
    # may create a number below the newest: it has lost, and takes its file back.
    if gens[-1] != gen:
        mine.unlink(missing_ok=True)
        return None
    for old in gens[:-1]:
        (folder / f"{old:020d}").unlink(missing_ok=True)
    return str(gen)
