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
import contextlib
import heapq
import itertools
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

_nice = 0


def lower_priority() -> None:
    """Give the calling thread (a Linux task of its own) the configured nice value.

    The daemon shares the host's cores with the trainer: its write, read and
    checksum threads yield to it (each save then reaches LOCAL a little later,
    the trainer's steps slow less). No-op where not allowed or not Linux."""
    if _nice > 0 and hasattr(os, "setpriority"):
        # A sandbox without the right: the thread runs at the process's priority.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _nice)


def set_nice(value: int) -> None:
    """The nice value of I/O and checksum threads started from now on (``io_nice``)."""
    global _nice
    _nice = value


CRC = concurrent.futures.ThreadPoolExecutor(
    1, thread_name_prefix="ckptd-crc", initializer=lower_priority
)
"""Checksums the bytes a write or read just moved, beside the next one (google_crc32c
releases the GIL): rank files as they are written and as they are restored. Its one
thread starts on first use, after the configuration set :func:`set_nice`."""


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
    """A bounded thread pool that runs the oldest work first: ``await io.run(fn, *args)``.

    Work is queued by ``ticket`` (by default, its place in line when submitted). A
    save takes one ticket when it is acknowledged and runs all of its work under
    it, so when saves arrive faster than the disk takes them, an older save's last
    steps (its records, its manifest, its rename) go before a newer save's writes,
    and saves reach LOCAL in the order they were acknowledged. A plain FIFO pool
    queued them behind every newer write and doubled their latency.
    """

    def __init__(self, threads: int) -> None:
        self._cond = threading.Condition()
        self._queue: list[tuple[int, int, concurrent.futures.Future[Any], Callable[[], Any]]] = []
        self._order = itertools.count()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"ckptd-io_{i}", daemon=True)
            for i in range(max(2, threads))
        ]
        for t in self._threads:
            t.start()

    def ticket(self) -> int:
        """A place in line: work run with it goes before work of any later ticket."""
        return next(self._order)

    def submit(
        self, fn: Callable[..., T], *args: Any, ticket: int | None = None
    ) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)``; its future. Raises RuntimeError once closed."""
        cf: concurrent.futures.Future[T] = concurrent.futures.Future()
        order = next(self._order)
        with self._cond:
            if self._closed:
                raise RuntimeError("the daemon's I/O pool is closed")
            entry = (order if ticket is None else ticket, order, cf, lambda: fn(*args))
            heapq.heappush(self._queue, entry)
            self._cond.notify()
        return cf

    async def run(self, fn: Callable[..., T], *args: Any, ticket: int | None = None) -> T:
        """Run blocking ``fn(*args)`` on an I/O thread and wait for it (settled)."""
        return await settled(self.submit(fn, *args, ticket=ticket))

    def close(self) -> None:
        """Run what is queued, then stop the threads."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    def _work(self) -> None:
        lower_priority()
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed, and nothing left
                _, _, cf, call = heapq.heappop(self._queue)
            if cf.set_running_or_notify_cancel():  # not cancelled before it started
                try:
                    cf.set_result(call())
                except BaseException as exc:
                    cf.set_exception(exc)
            # An idle thread keeps nothing of its last job: its arguments may be views of
            # a segment, which could not be unmapped while they live (pool.py).
            del call, cf
