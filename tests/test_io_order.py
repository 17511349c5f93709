"""The daemon's I/O pool runs the oldest work first (issue 13): a save's work carries
the ticket it took when acknowledged, so under overload an older save's last steps
go before a newer save's writes. Synchronised on events, never on sleeps."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ckptd.daemon.io import IoPool


def test_queued_work_runs_by_ticket_then_by_arrival() -> None:
    pool = IoPool(2)
    gates = [threading.Event(), threading.Event()]
    busy = threading.Barrier(3)
    ran: list[str] = []

    def hold(gate: threading.Event) -> None:
        busy.wait()
        gate.wait()

    held = [pool.submit(hold, g) for g in gates]
    busy.wait()  # both threads are busy: what follows queues
    old = pool.ticket()
    newer = pool.ticket()
    futures = [
        pool.submit(ran.append, "newer save's write", ticket=newer),
        pool.submit(ran.append, "untagged"),
        pool.submit(ran.append, "older save's manifest", ticket=old),
        pool.submit(ran.append, "newer save's crc", ticket=newer),
    ]
    gates[0].set()  # one thread free: it drains the queue in priority order
    for f in futures:
        f.result(timeout=30)
    assert ran == ["older save's manifest", "newer save's write", "newer save's crc", "untagged"]
    gates[1].set()
    for f in held:
        f.result(timeout=30)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(print)


def test_run_is_settled_and_failures_propagate() -> None:
    pool = IoPool(2)

    def boom() -> None:
        raise ValueError("disk on fire")

    async def main() -> int:
        with pytest.raises(ValueError, match="disk on fire"):
            await pool.run(boom)
        return await pool.run(sum, [1, 2, 3], ticket=pool.ticket())

    assert asyncio.run(main()) == 6
    pool.close()
