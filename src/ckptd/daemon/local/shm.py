"""Shared-memory mappings that keep no file descriptor open.

CPython's ``mmap.mmap`` keeps a ``dup`` of the file's descriptor for as long as
the mapping lives (3.13 added ``trackfd=False``; 3.11 has no way out), so a
pool of many small segments used to cost one fd each and ran into EMFILE under
``ulimit -n 1024``. A mapping outlives its descriptor in the kernel, so these
are made with ``mmap(2)`` through ctypes and the descriptor is closed at once.

``mmap.mmap.close`` refuses to unmap while views are exported; :meth:`close`
keeps that safety: it unmaps only when no view of the mapping is alive, and
otherwise leaves the mapping for the process's exit (never a use-after-unmap).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: allocate and map pages now, or fail (no SIGBUS)
_PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


@functools.cache
def can_populate() -> bool:
    """Whether this kernel populates ranges on request (MADV_POPULATE_WRITE, 5.14+);
    without it a mapping must be populated whole when made."""
    with mmap.mmap(-1, _PAGE) as probe:
        try:
            probe.madvise(_MADV_POPULATE_WRITE)
        except OSError:
            return False
    return True


class SharedMapping:
    """``size`` bytes of a file mapped shared and read-write; no fd is kept."""

    def __init__(self, fd: int, size: int, populate: bool = True) -> None:
        if size <= 0:
            raise ValueError(f"cannot map {size} bytes")
        flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate else 0)
        addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
        self.size = size
        self._addr: int | None = addr
        self._array = (ctypes.c_char * size).from_address(addr)

    @classmethod
    def open(cls, path: str | os.PathLike[str], size: int) -> SharedMapping:
        """Map an existing file (its first ``size`` bytes)."""
        fd = os.open(path, os.O_RDWR)
        try:
            return cls(fd, size)
        finally:
            os.close(fd)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` unmapped it."""
        return self._addr is None

    def view(self, offset: int = 0, length: int | None = None) -> memoryview:
        """A zero-copy view of ``length`` bytes at ``offset``."""
        if self._addr is None:
            raise ValueError("the mapping is closed")
        end = self.size if length is None else offset + length
        # A fresh memoryview each time: each holds its own reference to the array for
        # as long as it or anything made from it (slices, numpy arrays) lives, which is
        # what in_use() counts.
        return memoryview(self._array).cast("B")[offset:end]

    def populate(self, offset: int, length: int) -> None:
        """Allocate and map the pages of ``[offset, offset + length)`` now (a mapping
        made with ``populate=False``). Raises OSError where the memory cannot be had
        (a full /dev/shm), where touching the pages would have raised SIGBUS."""
        if self._addr is None:
            raise ValueError("the mapping is closed")
        start = offset - offset % _PAGE
        end = min(self.size, -(-(offset + length) // _PAGE) * _PAGE)
        if end <= start:
            return
        if _libc.madvise(self._addr + start, end - start, _MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot allocate shared memory: {os.strerror(err)}")

    def in_use(self) -> bool:
        """Whether some view (or array over one) of the mapping is still alive."""
        return sys.getrefcount(self._array) > 2  # ours and getrefcount's argument

    def close(self) -> bool:
        """Unmap if no view is alive; returns whether it did."""
        if self._addr is None:
            return True
        if self.in_use():
            return False
        if _libc.munmap(self._addr, self.size) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap failed: {os.strerror(err)}")
        self._addr = None
        return True
