"""Background work under supervision: nothing the daemon runs in the background dies silently.

Two kinds of work:

- services (the drain, the evictor, the adopter's scanner): loops that run for
  the daemon's life. One that raises is logged with its traceback, shown in
  ``ckptd status`` and restarted after a pause that doubles with each crash; a
  service that keeps crashing (``max_restarts`` within ``window_seconds``)
  stops the daemon with an error, because a daemon that silently stopped
  uploading is worse than one that exits and is restarted by its supervisor.
- jobs (one rank's write): one-shot work that shutdown waits for, since an
  acknowledged save must be completed. A job that raises is logged and counted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from ..retry import Backoff

log = logging.getLogger("ckptd.supervisor")


@dataclass
class TaskHealth:
    """What ``ckptd status`` shows about one background service."""

    name: str
    state: str = "starting"
    """running, restarting, stopped or failed."""
    restarts: int = 0
    last_error: str = ""
    crashes: collections.deque[float] = field(default_factory=collections.deque)


class Supervisor:
    """Runs services and jobs; ``on_fatal(reason)`` is called when a service gives up."""

    def __init__(
        self,
        on_fatal: Callable[[str], None],
        *,
        max_restarts: int = 5,
        window_seconds: float = 300.0,
        first_pause_seconds: float = 0.5,
        max_pause_seconds: float = 30.0,
    ) -> None:
        self.on_fatal = on_fatal
        self.max_restarts = max_restarts
        self.window_seconds = window_seconds
        self.first_pause_seconds = first_pause_seconds
        self.max_pause_seconds = max_pause_seconds
        self._pause = Backoff(first_pause_seconds, max_pause_seconds)
        """How long a crashed service waits before its restart, by crashes so far."""
        self.health: dict[str, TaskHealth] = {}
        self.job_errors = 0
        """One-shot jobs that raised (each is also logged)."""
        self._services: list[asyncio.Task[None]] = []
        self._jobs: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()

    # -- services ----------------------------------------------------------------
    def service(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run ``run()`` until :meth:`stop_services`; restart it whenever it raises."""
        health = self.health[name] = TaskHealth(name)
        self._services.append(asyncio.create_task(self._keep(health, run), name=name))

    async def _keep(self, health: TaskHealth, run: Callable[[], Awaitable[None]]) -> None:
        while not self._stopping.is_set():
            health.state = "running"
            try:
                await run()
                if self._stopping.is_set():
                    break
                raise RuntimeError("returned while the daemon is running")
            except asyncio.CancelledError:
                break
            except Exception as exc:
                log.exception("background service %s crashed", health.name)
                health.last_error = f"{type(exc).__name__}: {exc}"[:500]
                now = time.monotonic()
                health.crashes.append(now)
                while health.crashes and now - health.crashes[0] > self.window_seconds:
                    health.crashes.popleft()
                if len(health.crashes) > self.max_restarts:
                    health.state = "failed"
                    self.on_fatal(
                        f"background service {health.name} crashed {len(health.crashes)} times "
                        f"in {self.window_seconds:.0f} s (last: {health.last_error}); stopping"
                    )
                    return
                health.state = "restarting"
                health.restarts += 1
                pause = self._pause.delay(len(health.crashes) - 1)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), pause)
        health.state = "stopped"

    async def stop_services(self) -> None:
        """Let every service return (each is told to stop by its owner first), then wait."""
        self._stopping.set()
        if self._services:
            await asyncio.gather(*self._services, return_exceptions=True)

    # -- jobs ----------------------------------------------------------------------
    def spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        """Run one-shot work in the background; :meth:`finish_jobs` waits for it."""
        task = asyncio.create_task(coro, name=name)
        self._jobs.add(task)
        task.add_done_callback(self._job_done)

    def _job_done(self, task: asyncio.Task[None]) -> None:
        self._jobs.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.job_errors += 1
            log.error("background job %s failed", task.get_name(), exc_info=exc)

    @property
    def jobs_running(self) -> int:
        """One-shot jobs still running (acknowledged saves being written, ...)."""
        return len(self._jobs)

    async def finish_jobs(self) -> None:
        """Wait until every job has ended (shutdown: acknowledged saves are completed)."""
        while self._jobs:
            await asyncio.gather(*list(self._jobs), return_exceptions=True)
