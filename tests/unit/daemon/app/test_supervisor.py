"""Supervision of background work, alone (no daemon process)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from ckptd.daemon.app.supervisor import Supervisor


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def test_a_crashed_service_is_restarted_and_its_crash_shown() -> None:
    async def body() -> None:
        fatal: list[str] = []
        sup = Supervisor(fatal.append, first_pause_seconds=0.0)
        calls = 0
        healthy = asyncio.Event()
        stop = asyncio.Event()

        async def flaky() -> None:
            nonlocal calls
            calls += 1
            if calls <= 2:
                raise ValueError(f"crash {calls}")
            healthy.set()
            await stop.wait()

        sup.service("drain", flaky)
        await asyncio.wait_for(healthy.wait(), 5)
        health = sup.health["drain"]
        assert (health.state, health.restarts) == ("running", 2)
        assert health.last_error == "ValueError: crash 2"
        stop.set()
        await sup.stop_services()
        assert health.state == "stopped" and fatal == []

    run(body())


def test_a_service_that_keeps_crashing_stops_the_daemon() -> None:
    async def body() -> None:
        fatal: list[str] = []
        sup = Supervisor(fatal.append, max_restarts=3, first_pause_seconds=0.0)

        async def broken() -> None:
            raise OSError("disk on fire")

        sup.service("evictor", broken)
        await asyncio.wait_for(sup._services[0], 5)
        assert sup.health["evictor"].state == "failed"
        assert len(fatal) == 1 and "evictor crashed 4 times" in fatal[0]
        assert "disk on fire" in fatal[0]

    run(body())


def test_a_service_returning_early_counts_as_a_crash() -> None:
    async def body() -> None:
        fatal: list[str] = []
        sup = Supervisor(fatal.append, max_restarts=0, first_pause_seconds=0.0)

        async def quits() -> None:
            return None

        sup.service("adopter", quits)
        await asyncio.wait_for(sup._services[0], 5)
        assert "returned while the daemon is running" in sup.health["adopter"].last_error
        assert fatal

    run(body())


def test_jobs_are_awaited_at_shutdown_and_their_errors_counted() -> None:
    async def body() -> None:
        sup = Supervisor(lambda reason: None)
        release = asyncio.Event()
        finished: list[str] = []

        async def write() -> None:
            await release.wait()
            finished.append("written")

        async def fails() -> None:
            raise RuntimeError("write failed")

        sup.spawn("write j/1 rank 0", write())
        sup.spawn("write j/1 rank 1", fails())
        while sup.job_errors == 0:  # the failed job's done-callback runs on the loop
            await asyncio.sleep(0)
        assert sup.jobs_running == 1 and sup.job_errors == 1
        finishing = asyncio.create_task(sup.finish_jobs())
        await asyncio.sleep(0)
        assert not finishing.done()  # an acknowledged write is waited for
        release.set()
        await asyncio.wait_for(finishing, 5)
        assert finished == ["written"] and sup.jobs_running == 0

    run(body())
