"""Blocking file helpers beneath every tier: fsynced writes, atomic replace, and large
aligned ``O_DIRECT`` reads and writes between files and page-aligned memory.

These VMs are slow to hand out fresh page cache (docs/architecture.md,
"Performance notes"), so checkpoint bytes move with ``O_DIRECT`` through memory
that is already faulted in; filesystems that refuse it (tmpfs, some overlays) get plain I/O.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import mmap
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ckptd.core import checksum
from ckptd.core.format import round_up
from ckptd.core.health import NonFiniteCount

from . import faults
from .io import CRC

WRITE_CHUNK = 64 * 2**20
"""Bytes per write call: large enough for full NVMe queues, small enough to stay interruptible."""


def fsync_dir(path: Path) -> None:
    """fsync a directory so the entries in it (new files, renames) are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes, mode: int = 0o640) -> None:
    """Create ``path`` (it must not exist, not even as a symlink) holding ``data``, and
    fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_synced(path: Path, data: bytes, mode: int = 0o640) -> None:
    """Atomically replace ``path`` with ``data``: temp file, fsync, rename, fsync the dir."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        write_synced(tmp, data, mode)
        os.replace(tmp, path)
    except BaseException:  # a full disk: leave no partial temp file behind
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def read_small(path: Path) -> bytes:
    """A small file's bytes (a manifest), refusing a symlink in its place."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def open_direct(
    path: Path | str,
    flags: int,
    mode: int = 0o640,
    want: bool = True,
    dir_fd: int | None = None,
) -> tuple[int, bool]:
    """Open with ``O_DIRECT`` when ``want`` and the filesystem allows it (tmpfs and some
    overlays refuse it with EINVAL: then a plain open); returns ``(fd, direct)``.

    Always ``O_NOFOLLOW``: ckptd never makes symlinks in its tier, so one in place of a
    checkpoint file was planted there and must not redirect a read or a write.
    ``dir_fd``: ``path`` is relative to this open directory (see :func:`open_dir_beneath`).
    """
    flags |= os.O_NOFOLLOW
    direct = getattr(os, "O_DIRECT", 0) if want else 0
    if direct:
        try:
            return os.open(path, flags | direct, mode, dir_fd=dir_fd), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode, dir_fd=dir_fd), False


def open_dir_beneath(root_fd: int, rel: str, make: bool = False) -> int:
    """An fd of the directory ``rel`` (``a/b``; ``""`` is ``root_fd`` itself, duplicated)
    under the open directory ``root_fd``, walked one component at a time with
    ``O_NOFOLLOW``, so a symlink on the way (even one planted while we walk) fails the
    open (ELOOP / ENOTDIR) instead of leading out of the tree. ``make``: create missing
    directories (mode 0750). ``rel`` must be checked already (no ``..``, not absolute):
    this guards against symlinks, not against names."""
    fd = os.dup(root_fd)
    try:
        for part in filter(None, rel.split("/")):
            if make:
                # Made already by a sibling file's download (or a planted link: the
                # O_NOFOLLOW open below refuses that).
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o750, dir_fd=fd)
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_file_checksummed(
    path: Path,
    header: bytes,
    data: memoryview,
    data_length: int,
    ranges: Sequence[tuple[int, int]],
    spare: Path | None = None,
    pieces: checksum.Pieces | None = None,
    health: NonFiniteCount | None = None,
) -> tuple[int, list[int]]:
    """:func:`write_file_direct`, returning the crc32c of the whole file and of each
    ``(offset, length)`` shard range of ``data`` (``pieces``: their
    :func:`~ckptd.core.checksum.file_pieces`, if known). ``health``, if given, counts
    the floating shards' NaN/Inf on the same trailing pass (core/health.py).

    The checksum runs on the crc thread one chunk behind the write, over the chunk
    just written, so disk and checksum overlap. Started beside the write over the
    whole buffer at once, it raced the write for memory bandwidth and slowed it by
    a quarter here (bench_transformer; the chunked trail costs ~5%).
    """
    stream = checksum.FileCrc(header, ranges, data_length, pieces)
    flat = np.frombuffer(data, np.uint8)

    def trail(upto: int) -> None:
        stream.feed(flat, upto)
        if health is not None:  # the chunk the crc just read, while it is in cache
            health.feed(flat, upto)

    pending: list[concurrent.futures.Future[None]] = []
    if data_length == 0:
        # No data, so the writer never reports any: the shards (all zero-size) still
        # need their crcs, or the file's checksum refuses a save that was acknowledged.
        trail(0)
    try:
        write_file_direct(
            path,
            header,
            data,
            data_length,
            spare,
            lambda upto: pending.append(CRC.submit(trail, upto)),
        )
    finally:
        # The checksum reads the lease: it ends before the lease can be given back.
        concurrent.futures.wait(pending)
    for done in pending:
        done.result()
    return stream.result()


def write_file_direct(
    path: Path,
    header: bytes,
    data: memoryview,
    data_length: int,
    spare: Path | None = None,
    on_data: Callable[[int], None] | None = None,
) -> None:
    """Write ``header`` then the first ``data_length`` bytes of ``data``, fsync, close.

    ``header`` is a multiple of 4 KiB and ``data`` is page-aligned memory at
    least ``round_up(data_length)`` long, so the whole file goes out in aligned
    ``O_DIRECT`` writes (no page-cache allocation, which is slow on these VMs);
    the padding past the true end is truncated away. Falls back to buffered
    writes where the filesystem refuses O_DIRECT (tmpfs, some overlays).
    ``spare``: an old file to overwrite in place instead of creating one (its
    blocks are already allocated, which makes the write and fsync faster);
    every byte up to the new size is overwritten and the rest truncated.
    ``on_data(n)``: called as the first ``n`` bytes of ``data`` are written (in
    order; a restart in buffered mode starts again from 0).
    """
    if spare is not None:  # first: whatever fails next, the staging dir's cleanup has it
        os.rename(spare, path)
    faults.hit("write.begin")
    padded = round_up(data_length)
    if len(data) < padded:
        raise ValueError("lease view shorter than the padded data section")
    if spare is not None:
        fd, direct = open_direct(path, os.O_WRONLY)
    else:
        fd, direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        if direct:
            try:
                _write_all(fd, header, data, padded, on_data, aligned=True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(fd)
                fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW, 0o640)
                _write_all(fd, header, data, data_length, on_data, aligned=False)
        else:
            _write_all(fd, header, data, data_length, on_data, aligned=False)
        os.ftruncate(fd, len(header) + data_length)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_runs_direct(
    path: Path, header: bytes, data: memoryview, runs: Sequence[tuple[int, int]]
) -> int:
    """Write an incremental rank file: each ``(image start, length)`` run of the
    image (``header`` then ``data``, the lease's data section) one after the other,
    fsync, close; returns the file's crc32c.

    Runs start on 4 KiB boundaries and all but the last are whole blocks
    (core/increments.round_runs), so each goes out with aligned ``O_DIRECT`` writes
    straight from the lease, like a full file; the last is padded and the padding
    truncated away. The first run starts with the header."""
    faults.hit("write.begin")
    head = len(header)
    pieces: list[tuple[int, int, int]] = []  # file offset, data offset, length
    at = 0
    for start, length in runs:
        if start < head:  # the first run: the header, then the data it reaches into
            pieces.append((at + head, 0, start + length - head))
        else:
            pieces.append((at, start - head, length))
        at += length
    fd, direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    crc = checksum.value(header)
    try:
        if direct:  # O_DIRECT needs an aligned source buffer; anonymous mmaps are
            with mmap.mmap(-1, len(header)) as buf:
                buf.write(header)
                _pwrite_all(fd, memoryview(buf), 0)
        else:
            _pwrite_all(fd, memoryview(header), 0)
        for offset, start, length in pieces:
            crc = checksum.extend(crc, data[start : start + length])
            # Whole blocks for O_DIRECT: only the last run can end inside one, and the
            # lease is at least its data rounded up, so the padding is the lease's.
            n = round_up(length) if direct else length
            _pwrite_all(fd, data[start : start + n], offset)
        os.ftruncate(fd, at)
        os.fsync(fd)
    finally:
        os.close(fd)
    return crc


def _write_all(
    fd: int,
    header: bytes,
    data: memoryview,
    length: int,
    on_data: Callable[[int], None] | None,
    aligned: bool,
) -> None:
    if aligned:
        # O_DIRECT needs an aligned source buffer; anonymous mmaps are page-aligned.
        with mmap.mmap(-1, len(header)) as buf:
            buf.write(header)
            _pwrite_all(fd, memoryview(buf), 0)
    else:
        _pwrite_all(fd, memoryview(header), 0)
    pos = 0
    while pos < length:
        n = min(WRITE_CHUNK, length - pos)
        _pwrite_all(fd, data[pos : pos + n], len(header) + pos)
        pos += n
        if on_data is not None:
            on_data(pos)
        if pos < length:
            faults.hit("write.mid")


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.pwrite(fd, buf, offset)
        buf = buf[n:]
        offset += n


def read_data_direct(
    path: Path,
    offset: int,
    length: int,
    dest: memoryview,
    chunk: int = WRITE_CHUNK,
    on_chunk: Callable[[int, int], None] | None = None,
) -> None:
    """Read ``length`` bytes at ``offset`` (a multiple of 4 KiB) into page-aligned ``dest``.

    The mirror of :func:`write_file_direct`: large aligned ``O_DIRECT`` reads into
    memory that is already faulted in, so no page cache is allocated. Raises
    ``ValueError`` if the file is shorter than expected. ``on_chunk(pos, n)`` is
    called as each ``chunk`` (a multiple of 4 KiB) lands: ``n`` bytes of the file's
    data at ``dest[pos:]`` (a checksum can run on them while the next is read).
    """
    if len(dest) < round_up(length):
        raise ValueError("destination shorter than the padded read")
    fd, _ = open_direct(path, os.O_RDONLY)
    try:
        pos = 0
        while pos < length:
            # Whole blocks even past the end of the file: O_DIRECT needs them; the
            # kernel stops at EOF.
            n = min(chunk, round_up(length) - pos)
            got = os.preadv(fd, [dest[pos : pos + n]], offset + pos)
            if got <= 0:
                raise ValueError(f"{path} ends {length - pos} bytes early")
            if on_chunk is not None:
                on_chunk(pos, min(got, length - pos))
            pos += got
    finally:
        os.close(fd)


def read_header(path: Path, length: int) -> bytes:
    """The first ``length`` bytes of a file (a safetensors header: its crc is part
    of the file's)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        head = os.pread(fd, length, 0)
    finally:
        os.close(fd)
    if len(head) != length:
        raise ValueError(f"{path} ends inside its {length}-byte header")
    return head


def data_offset(path: Path) -> int:
    """Where the data section of a safetensors file starts (8 + header length)."""
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path} is too short to be a safetensors file")
    return 8 + int.from_bytes(raw, "little")
