"""A replica being received (replicas.py): its rank files written as the bytes come,
each checked against the crc32c its manifest records, then handed to the store to
make it visible (``commit``: what that gives back, the replica held, is ``T``)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from ckptd.core import checksum
from ckptd.core.errors import InvalidArgument
from ckptd.core.format import ALIGN, round_up
from ckptd.core.manifest import Manifest, RankRecord
from ckptd.core.names import UNKNOWN_OWNER, Owner

from ..files import open_direct

BUFFER = 4 * 2**20
"""Bytes gathered before a write (a multiple of ALIGN; the buffer holds two)."""


T = TypeVar("T")


class Incoming(Generic[T]):
    """A replica being received: its rank files' bytes in manifest order, back to back.

    Written with ``O_DIRECT`` from one reused page-aligned buffer (whole blocks; the
    padding past a file's end is cut off), so a replica allocates no page cache,
    whose fresh memory is slow on these VMs and taken from the trainer beside it."""

    def __init__(
        self,
        commit: Callable[[Incoming[T]], T],
        drop: Callable[[Incoming[T]], None],
        path: Path,
        manifest: Manifest,
        raw: str,
        begun: int = 0,
        holder_for: int = 0,
        owner: Owner = UNKNOWN_OWNER,
    ) -> None:
        self._on_commit, self._on_drop = commit, drop
        """The store's: make it visible (whole), and drop it (replicas.py)."""
        self.path, self.manifest, self.raw = path, manifest, raw
        self.owner = owner
        """The job's owner on the source, as it said (kept with the replica)."""
        self.begun = begun
        """Its place in the order receptions began (ReplicaStore)."""
        self.holder_for = holder_for
        """The newer step it is sent ahead of (0: its source's head)."""
        self._files: list[RankRecord] = list(manifest.ranks)
        self._index = 0
        self._done = 0  # bytes of the current file taken in
        self._written = 0  # of those, written to the file (a multiple of ALIGN)
        self._crc = 0
        self._fd = -1
        self._direct = False
        self._buf = mmap.mmap(-1, 2 * BUFFER)
        self._fill = 0  # bytes waiting in the buffer

    def _open(self, record: RankRecord) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        self._fd, self._direct = open_direct(self.path / record.file, flags)

    def write(self, data: bytes | memoryview) -> None:
        """Take the next bytes; a file whose bytes are all in is checked and closed."""
        view = memoryview(data)
        while view:
            if self._index >= len(self._files):
                raise InvalidArgument("more bytes than the manifest's files hold")
            record = self._files[self._index]
            if self._fd < 0:
                self._open(record)
            take = view[: min(record.size - self._done, BUFFER)]
            self._buf[self._fill : self._fill + len(take)] = take
            self._fill += len(take)
            self._crc = checksum.extend(self._crc, take)
            self._done += len(take)
            view = view[len(take) :]
            if self._fill >= BUFFER:
                self._flush(whole=False)
            if self._done == record.size:
                self._close_file(record)

    def _flush(self, whole: bool) -> None:
        """Write the buffer's whole blocks (``whole``: all of it, padded to a block)."""
        n = round_up(self._fill) if whole else self._fill // ALIGN * ALIGN
        if not n:
            return
        if whole:
            self._buf[self._fill : n] = bytes(n - self._fill)
        view = memoryview(self._buf)[:n]
        if not self._direct:  # a filesystem without O_DIRECT: the bytes as they are
            view = view[: min(n, self._fill)]
        pos = 0
        while pos < len(view):
            pos += os.pwrite(self._fd, view[pos:], self._written + pos)
        rest = self._fill - n
        if rest > 0:
            self._buf[:rest] = self._buf[n : self._fill]
        self._written += n
        self._fill = max(rest, 0)

    def _close_file(self, record: RankRecord) -> None:
        if self._fd < 0:  # an empty file: nothing was written
            self._open(record)
        self._flush(whole=True)
        os.ftruncate(self._fd, record.size)  # the block padding past its end
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        if self._crc != record.crc32c:
            raise InvalidArgument(
                f"{record.file} arrived with crc32c {self._crc:08x}, not {record.crc32c:08x}"
            )
        self._index, self._done, self._written, self._crc = self._index + 1, 0, 0, 0

    def finish(self) -> T:
        """Every file is in and checked: make the replica visible."""
        while self._index < len(self._files) and self._files[self._index].size == 0:
            self._close_file(self._files[self._index])
        if self._index < len(self._files):
            missing = self._files[self._index].file
            raise InvalidArgument(f"the stream ended before {missing} was complete")
        self._buf.close()
        return self._on_commit(self)

    def abort(self) -> None:
        """Drop what was received."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._buf.close()
        self._on_drop(self)
