"""The daemon's I/O threads: blocking file work and checksums run here, off the event loop.

Cancelling a coroutine does not stop a thread. A transfer that fails must not
give its memory back while a sibling's thread still writes into it, so every
thread call here is *settled*: a cancelled caller waits for its thread to end
before the cancellation goes on, and :func:`gather_all` cancels the siblings of
a failed task and waits for all of them before it raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


async def settled(cf: concurrent.futures.Future[T]) -> T:
    """Await a thread's future; if cancelled, first wait until the thread is done."""
    waiter = asyncio.wrap_future(cf)
    try:
        return await asyncio.shield(waiter)
    except asyncio.CancelledError:
        cf.cancel()  # not started yet: it never will
        while not cf.done():
            try:
                await asyncio.wait([waiter])
            except asyncio.CancelledError:
                continue  # cancelled again: still wait, then raise once
        raise


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``asyncio.to_thread`` that never leaves its thread running behind a cancellation."""
    loop = asyncio.get_running_loop()
    cf: concurrent.futures.Future[T] = concurrent.futures.Future()

    def call() -> None:
        if not cf.set_running_or_notify_cancel():
            return
        try:
            cf.set_result(fn(*args))
        except BaseException as exc:
            cf.set_exception(exc)

    loop.run_in_executor(None, call)  # the loop's default pool, as asyncio.to_thread
    return await settled(cf)


async def gather_all(*aws: Awaitable[Any]) -> list[Any]:
    """Like ``asyncio.gather``, but the first failure cancels the others and waits for
    every one of them to end before it is raised (so no sibling still writes)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        # On a failure, or our own cancellation: stop the rest, and wait for them all.
        for t in tasks:
            if not t.done():
                t.cancel()
        while not all(t.done() for t in tasks):
            try:
                await asyncio.wait(tasks)
            except asyncio.CancelledError:
                continue
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]


class IoPool:
    """A bounded thread pool; ``await io.run(fn, *args)`` runs ``fn`` on it."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max(2, threads), "ckptd-io")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking ``fn(*args)`` on an I/O thread and wait for it (settled)."""
        return await settled(self._pool.submit(fn, *args))

    def close(self) -> None:
        """Wait for running work, then stop the threads."""
        self._pool.shutdown(wait=True)
