"""How an object moves in parts: the part boundaries, and the reused buffers they pass through.

Beneath both directions of the remote tier (uploads in base.py, ranged
downloads in ranged.py), so neither imports the other for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
from collections.abc import AsyncIterator

import numpy as np


class BufferPool:
    """``count`` page-aligned buffers of ``size`` bytes, touched once and reused."""

    def __init__(self, count: int, size: int) -> None:
        self.size = size
        self._free: asyncio.Queue[mmap.mmap] = asyncio.Queue()
        self._count = count
        self._made = 0

    @contextlib.asynccontextmanager
    async def buffer(self) -> AsyncIterator[mmap.mmap]:
        """Borrow a buffer (waits if all are in use)."""
        if self._free.empty() and self._made < self._count:
            self._made += 1
            buf = mmap.mmap(-1, self.size)
            np.frombuffer(buf, np.uint8)[:: mmap.PAGESIZE] = 0  # fault it in once
            self._free.put_nowait(buf)
        buf = await self._free.get()
        try:
            yield buf
        finally:
            self._free.put_nowait(buf)


def parts(size: int, part_size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each part of a file (at least one, even if empty)."""
    return [(o, min(part_size, size - o)) for o in range(0, size, part_size)] or [(0, 0)]
