"""Hardware floors: the fastest plain way to move the same bytes, measured in the same run.

- memcpy into a pre-touched, page-aligned buffer (:func:`memcpy_into`);
- write + fsync of a new file, buffered or ``O_DIRECT`` (:func:`write_file`);
- read into a pre-touched buffer, buffered or ``O_DIRECT`` (:func:`read_file`).

Buffers are anonymous mmaps (page-aligned, as ``O_DIRECT`` needs) touched once
up front, because on these VMs touching fresh memory costs more than the copy
itself (see docs/architecture.md, "Performance notes"). I/O goes in 64 MiB chunks.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

PAGE = 4096
CHUNK = 64 * 2**20
"""Bytes per pwrite/preadv call, as the daemon's writer uses."""


class DirectIOUnsupported(OSError):
    """The filesystem refused ``O_DIRECT`` (e.g. tmpfs)."""


def round_up(n: int, multiple: int = PAGE) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def touched_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous mapping of ``round_up(nbytes)`` bytes, every page written once."""
    buf = mmap.mmap(-1, round_up(max(nbytes, 1)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    np.frombuffer(buf, np.uint8).fill(0)
    return buf


def packed_offsets(arrays: Sequence[np.ndarray]) -> list[int]:
    """Offsets placing ``arrays`` back to back, each starting on a page boundary."""
    offsets, pos = [], 0
    for a in arrays:
        offsets.append(pos)
        pos += round_up(a.nbytes)
    return offsets


def packed_size(arrays: Sequence[np.ndarray]) -> int:
    """Bytes :func:`packed_offsets` needs for ``arrays``."""
    return sum(round_up(a.nbytes) for a in arrays)


def memcpy_into(arrays: Sequence[np.ndarray], buf: mmap.mmap, offsets: Sequence[int]) -> None:
    """``np.copyto`` each array into its view of ``buf`` (the memcpy floor)."""
    for a, off in zip(arrays, offsets, strict=True):
        dst = np.ndarray(a.shape, a.dtype, buffer=buf, offset=off)
        np.copyto(dst, a, casting="no")


def touch(arrays: Mapping[str, np.ndarray] | Sequence[np.ndarray]) -> int:
    """Read every byte of every array (a vectorised max over a uint8 view); returns a checksum."""
    values = arrays.values() if isinstance(arrays, Mapping) else arrays
    acc = 0
    for a in values:
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        acc ^= int(flat.max()) if flat.size else 0
    return acc


def write_file(path: Path, buf: mmap.mmap, length: int, *, direct: bool) -> None:
    """Create ``path`` with the first ``length`` bytes of ``buf``, fsync it, close it.

    With ``direct`` the file is opened ``O_DIRECT`` and written in page-aligned
    chunks straight from ``buf`` (padded to a page, then truncated to ``length``);
    raises :class:`DirectIOUnsupported` where the filesystem refuses it.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct:
        flags |= _o_direct()
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:
            raise DirectIOUnsupported(exc.errno, f"O_DIRECT refused for {path}") from None
        raise
    try:
        total = round_up(length) if direct else length
        if total > len(buf):
            raise ValueError(f"buffer holds {len(buf)} bytes, {total} needed")
        view = memoryview(buf)
        try:
            pos = 0
            while pos < total:
                n = os.pwrite(fd, view[pos : min(pos + CHUNK, total)], pos)
                if n <= 0:
                    raise OSError(errno.EIO, f"pwrite returned {n}")
                pos += n
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                raise DirectIOUnsupported(exc.errno, f"O_DIRECT write refused for {path}") from None
            raise
        finally:
            view.release()
        if total != length:
            os.ftruncate(fd, length)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: Path, buf: mmap.mmap, length: int, *, direct: bool) -> int:
    """Read the first ``length`` bytes of ``path`` into ``buf``; returns the bytes read.

    Buffered reads go through the page cache (``preadv`` = ``readinto``); direct
    reads open the file ``O_DIRECT`` and read page-aligned chunks into ``buf``.
    """
    flags = os.O_RDONLY | (_o_direct() if direct else 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:
            raise DirectIOUnsupported(exc.errno, f"O_DIRECT refused for {path}") from None
        raise
    view = memoryview(buf)
    try:
        total = round_up(length) if direct else length
        if total > len(buf):
            raise ValueError(f"buffer holds {len(buf)} bytes, {total} needed")
        pos = 0
        while pos < length:
            try:
                n = os.preadv(fd, [view[pos : min(pos + CHUNK, total)]], pos)
            except OSError as exc:
                if direct and exc.errno == errno.EINVAL:
                    raise DirectIOUnsupported(exc.errno, f"O_DIRECT read refused: {path}") from None
                raise
            if n <= 0:
                raise OSError(errno.EIO, f"{path} ended after {pos} of {length} bytes")
            pos += n
        return min(pos, length)
    finally:
        view.release()
        os.close(fd)


def _o_direct() -> int:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        raise DirectIOUnsupported(errno.EINVAL, "this platform has no O_DIRECT")
    return flag
