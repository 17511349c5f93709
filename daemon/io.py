"""The daemon's I/O threads: blocking file work and checksums run here, off the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class IoPool:
    """A bounded thread pool; ``await io.run(fn, *args)`` runs ``fn`` on it."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max(2, threads), "ckptd-io")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking ``fn(*args)`` on an I/O thread and wait for it."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        """Wait for running work, then stop the threads."""
        self._pool.shutdown(wait=True)
