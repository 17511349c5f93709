"""The remote tier's one adapter: fsspec for ``s3://`` (s3fs), ``gs://`` (gcsfs), ``file://``.

Every backend runs on fsspec's async API on the daemon's event loop
(``skip_instance_cache=True`` so rotated credentials are picked up), reads
local files in parts with ``O_DIRECT`` into a small pool of reused buffers, and
checks each upload against the crc32c recorded at local commit:

- S3: multipart upload with ``ChecksumAlgorithm=CRC32C`` and each part's
  checksum sent along, so the store verifies every part it receives; the parts'
  checksums, combined, must equal the file's commit-time crc32c.
- GCS: the object's native ``crc32c`` must equal the commit-time crc32c.
- file://: each part's crc32c is computed from the bytes written; the file is
  written under a temporary name, fsynced and renamed.

Each backend (file.py, gcs.py, s3.py: registered in backends.py) writes objects
and classifies its own errors (:meth:`Remote.is_transient`); everything else is
here. Credentials come from each library's standard provider chain and are
never logged.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import mmap
import os
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from ckptd.core import checksum
from ckptd.core.format import round_up

from .. import faults
from ..commit import Commit, MarkerCommit
from ..files import open_direct
from ..io import gather_all, in_thread
from .buffers import BufferPool, parts
from .errors import CONNECTION_ERRORS, TRANSIENT_ERRNOS, RemoteError
from .layout import COMMIT_FILE
from .ranged import (
    Populate,
    RangeError,
    RangeReader,
    RangeSource,
    Transfer,
    proxy_configured,
)

log = logging.getLogger("ckptd.remote")


def read_part(path: Path, offset: int, length: int, buf: mmap.mmap) -> tuple[int, int]:
    """Read ``length`` bytes at ``offset`` into ``buf`` (O_DIRECT if aligned); -> (n, crc32c)."""
    faults.hit("drain.part")
    fd, direct = open_direct(path, os.O_RDONLY, want=offset % 4096 == 0)
    try:
        view = memoryview(buf)
        want = round_up(length) if direct else length
        got = 0
        while got < length:
            n = os.preadv(fd, [view[got:want]], offset + got)
            if n <= 0:
                raise RemoteError(f"{path} ended early at byte {offset + got}", transient=False)
            got += n
    finally:
        os.close(fd)
    return length, checksum.extend(0, np.frombuffer(buf, np.uint8, length))


def _checksum_and_write(
    fd: int, direct: bool, src: memoryview, start: int, length: int, at: int
) -> int:
    """crc32c of ``src[start:start+length]``, written to the file at ``at``."""
    value = checksum.extend(0, np.frombuffer(src, np.uint8, length, start))
    _write_part(fd, direct, src, start, length, at)
    return value


def _write_part(
    fd: int, direct: bool, src: memoryview, start: int, length: int, at: int | None = None
) -> None:
    """Write ``src[start:start+length]`` at file offset ``at`` (default ``start``); with
    O_DIRECT the length is padded to a whole block (the file is truncated afterwards)."""
    at = start if at is None else at
    n = round_up(length) if direct else length
    view = src[start : start + n]
    while len(view):
        done = os.pwrite(fd, view, at)
        view, at = view[done:], at + done


def _truncate_and_sync(fd: int, size: int) -> None:
    os.ftruncate(fd, size)
    os.fsync(fd)


class Remote(abc.ABC):
    """Operations the drain and restore need, on top of an fsspec async filesystem."""

    scheme = ""
    rewrite_seconds = 0.0
    """Least time between two writes of the same object name the store takes."""

    def __init__(self, url: str, fs: Any, root: str, part_size: int, concurrency: int) -> None:
        self.url = url.rstrip("/")
        self.fs = fs
        self.root = root.rstrip("/")
        self.part_size = part_size
        self.concurrency = concurrency
        self.buffers = BufferPool(concurrency, part_size)
        self._limit = asyncio.Semaphore(concurrency)
        self._ranges: RangeReader | None = None

    def is_transient(self, exc: BaseException) -> bool:
        """Errors worth retrying: connection trouble, timeouts, throttling, 5xx, bad
        checksums. Backends add their own codes in :meth:`_transient`."""
        if isinstance(exc, RemoteError):
            return exc.transient
        cause = exc.__cause__ or exc.__context__
        # Libraries wrap their errors (s3fs: botocore's InternalError -> OSError(EREMOTEIO)).
        wrapped = cause is not None and cause is not exc and not isinstance(exc, FileNotFoundError)
        if wrapped and cause is not None and self.is_transient(cause):
            return True
        if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError):
            return False
        if isinstance(exc, ConnectionError | TimeoutError | asyncio.TimeoutError):
            return True
        if type(exc).__name__ in CONNECTION_ERRORS or self._transient(exc):
            return True
        return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS

    def _transient(self, exc: BaseException) -> bool:
        """The backend's own transient errors (its error codes); none by default."""
        return False

    def path(self, key: str) -> str:
        """The fsspec path of a key relative to the remote root."""
        return f"{self.root}/{key}" if key else self.root

    async def _bounded(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        async with self._limit:
            return await fn()

    # -- reads and listings (shared by all backends) --------------------------------
    async def check(self) -> None:
        """Fail fast at start-up if the remote is unreachable or the credentials are refused."""
        await self.fs._ls(self.root.split("/")[0] if self.scheme != "file" else self.root)

    async def get_bytes(self, key: str) -> bytes:
        """A whole (small) object."""
        data: bytes = await self.fs._cat_file(self.path(key))
        return data

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object."""
        data: bytes = await self.fs._cat_file(self.path(key), start=start, end=end)
        return data

    async def read_range_into(self, key: str, start: int, length: int, dst: memoryview) -> None:
        """Read ``length`` bytes of an object at ``start`` into ``dst`` (backends may stream)."""
        data = await self.get_range(key, start, start + length)
        if len(data) != length:
            raise RemoteError(f"{key}: short read at {start}", transient=True)
        dst[:length] = data

    async def list_keys(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (recursive), relative to the remote root."""
        self.fs.invalidate_cache()
        try:
            found = await self.fs._find(self.path(prefix), detail=True)
        except FileNotFoundError:
            return []
        base = self.root + "/"
        # Only objects: stores that emulate directories (SeaweedFS) list those too.
        return sorted(
            p[len(base) :]
            for p, info in found.items()
            if info.get("type") == "file" and p.startswith(base) and not p.endswith("/")
        )

    async def list_dirs(self, prefix: str) -> list[str]:
        """The names directly under ``prefix`` (a delimited listing: one request per
        1,000 names, not per key below them), as keys relative to the remote root."""
        self.fs.invalidate_cache()
        try:
            found = await self.fs._ls(self.path(prefix.rstrip("/")), detail=False)
        except FileNotFoundError:
            return []
        base = self.root + "/"
        return sorted(str(p)[len(base) :].rstrip("/") for p in found if str(p).startswith(base))

    async def exists(self, key: str) -> bool:
        """Whether an object exists."""
        return bool(await self.fs._exists(self.path(key)))

    async def delete(self, keys: list[str]) -> None:
        """Delete objects (missing ones are ignored)."""
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                await self.fs._rm_file(self.path(key))

    async def download(
        self,
        key: str,
        dest: Path | str,
        size: int,
        into: memoryview | None = None,
        dir_fd: int | None = None,
        populate: Populate | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Download an object into ``dest`` with parallel ranged reads; returns its crc32c.

        Each part lands in page-aligned memory (``into``, a page-aligned view of at
        least ``round_up(size)`` bytes that keeps the whole object, or else a pooled
        buffer) and is written from there with ``O_DIRECT`` as it arrives: no page
        cache is allocated and the disk write overlaps the network. Where the backend
        gives a :meth:`range_source`, parts are plain ranged GETs on worker threads
        (ranged.py: nothing per byte on the event loop); otherwise through fsspec.
        ``dest`` is a new file (``O_EXCL | O_NOFOLLOW``: never an existing file or a
        symlink's target), relative to the directory ``dir_fd`` if given. ``populate``
        allocates each range of ``into`` just before a part lands there. ``progress(n)``
        is called on the event loop as each part of ``n`` bytes is in (progress bars,
        the daemon's fetch status: by bytes, not by file).
        """
        fd, direct = open_direct(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, dir_fd=dir_fd)
        try:
            pieces = parts(size, self.part_size)
            source = await self.range_source(key) if size and not proxy_configured() else None
            if source is not None:
                crcs = await self._download_threaded(
                    key, source, fd, direct, pieces, into, populate, progress
                )
            else:
                crcs = await self._download_fsspec(
                    key, fd, direct, pieces, into, populate, progress
                )
            await in_thread(_truncate_and_sync, fd, size)  # drop the O_DIRECT padding
        finally:
            os.close(fd)
        return checksum.combine_all([(c, n) for c, (_, n) in zip(crcs, pieces, strict=True)])

    async def _download_threaded(
        self,
        key: str,
        source: RangeSource,
        fd: int,
        direct: bool,
        pieces: list[tuple[int, int]],
        into: memoryview | None,
        populate: Populate | None,
        progress: Callable[[int], None] | None,
    ) -> list[int]:
        if self._ranges is None:
            self._ranges = RangeReader(self.concurrency, self.ssl_context)
        try:
            return await self._ranges.download(
                Transfer(key, fd, direct),
                pieces,
                into,
                source,
                self.range_source,
                self.buffers,
                populate,
                progress,
            )
        except RangeError as exc:
            raise RemoteError(str(exc), exc.transient) from None

    async def _download_fsspec(
        self,
        key: str,
        fd: int,
        direct: bool,
        pieces: list[tuple[int, int]],
        into: memoryview | None,
        populate: Populate | None,
        progress: Callable[[int], None] | None,
    ) -> list[int]:
        async def one(offset: int, length: int) -> int:
            crc = await part(offset, length)
            if progress is not None:
                progress(length)
            return crc

        async def part(offset: int, length: int) -> int:
            if faults.armed("fetch.part"):
                await in_thread(faults.hit, "fetch.part")
            if length == 0:
                return 0  # s3fs reads the whole object for an empty range
            async with contextlib.AsyncExitStack() as stack:
                if into is not None:
                    dst, start = into, offset
                    if populate is not None:
                        await in_thread(populate, offset, round_up(length))
                else:
                    dst, start = (
                        memoryview(await stack.enter_async_context(self.buffers.buffer())),
                        0,
                    )
                await self._bounded(lambda: self.read_range_into(key, offset, length, dst[start:]))
                # Checksum and write on a worker thread: the loop only moves bytes.
                return await in_thread(_checksum_and_write, fd, direct, dst, start, length, offset)

        # A failed part stops its siblings before the memory (a lease) is given back.
        return await gather_all(*(one(o, n) for o, n in pieces))

    @property
    def ranged_parts(self) -> int:
        """Parts downloaded so far by plain ranged GETs on worker threads (ranged.py)."""
        return self._ranges.parts_read if self._ranges is not None else 0

    async def range_source(self, key: str) -> RangeSource | None:
        """How worker threads may GET byte ranges of ``key`` with plain HTTP(S) (a URL
        and headers), or None: downloads then go through the fsspec library."""
        return None

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS settings for :meth:`range_source` URLs (the system's CAs by default)."""
        return ssl.create_default_context()

    # -- backend-specific ----------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def open(cls, url: str, endpoint_url: str, part_size: int, concurrency: int) -> Remote:
        """The backend for ``url`` (its library's filesystem, configured)."""

    @abc.abstractmethod
    async def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object whole, verified against its crc32c."""

    @abc.abstractmethod
    async def put_file(self, local: Path, key: str, size: int, crc32c: int) -> None:
        """Upload a local file, verified end to end against ``crc32c`` (commit-time value)."""

    @abc.abstractmethod
    async def native_crc32c(self, key: str) -> int | None:
        """The store's own crc32c of an object, if it keeps one."""

    # -- compare-and-swap of one small object (claim.py) --------------------------------
    conditional_writes = False
    """Whether :meth:`write_if` is a true compare-and-swap on this store."""

    async def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """A small object and its version (what :meth:`write_if` compares), or None if
        it is not there. Default: the bytes' crc32c stands for the version."""
        try:
            data = await self.get_bytes(key)
        except FileNotFoundError:
            return None
        return data, str(checksum.value(data))

    async def write_if(self, key: str, data: bytes, version: str | None) -> str | None:
        """Write ``data`` only if the object's version is still ``version`` (None: only
        if it does not exist); returns the new version, or None when that precondition
        failed. Default (``conditional_writes`` False): read, compare, write: two writers
        in the same instant can both win, the next compare finds the loser out."""
        current = await self.read_versioned(key)
        if (current[1] if current is not None else None) != version:
            return None
        await self.put_bytes(key, data)
        return str(checksum.value(data))

    # -- adopted trees (see layout.py) ------------------------------------------------
    def tree_commit(self, tree: str, records: str, node: str) -> Commit:
        """The commit of an adopted tree published at ``tree`` (its framework's commit
        file, ``commit_success.txt``, is the marker). Object stores: written in place,
        the commit file last (Orbax on ``gs://`` counts a step only once it exists)."""
        return MarkerCommit(self, tree, f"{tree}/{COMMIT_FILE}")

    async def retract_tree(self, tree: str, records: str, node: str) -> None:
        """Hide an adopted tree from its framework before its objects are deleted:
        its commit file goes first, so no reader sees a half-deleted step."""
        await self.delete([f"{tree}/{COMMIT_FILE}"])

    async def close(self) -> None:
        """Close the library's HTTP session (s3fs / gcsfs keep one open) and the
        download threads' connections."""
        if self._ranges is not None:
            await asyncio.to_thread(self._ranges.close)
            self._ranges = None
        s3 = getattr(self.fs, "_s3", None)
        if s3 is not None:
            await s3.close()
        session = getattr(self.fs, "_session", None)
        if session is not None and not session.closed:
            await session.close()

    async def cleanup_incomplete(self, prefix: str) -> int:
        """Remove upload leftovers under ``prefix`` that are not objects (S3 multipart
        uploads a killed daemon left open); returns how many. Nothing to do elsewhere:
        file:// renames into place and GCS expires abandoned resumable sessions."""
        return 0

    def mismatch(self, key: str, what: str, got: int, want: int) -> RemoteError:
        """The error for an upload whose checksum disagrees (retried: the next try re-sends)."""
        return RemoteError(
            f"{self.url}/{key}: {what} crc32c {got:#010x} != {want:#010x} recorded at local commit",
            transient=True,
        )
