"""The daemon's I/O pool runs the oldest work first (issue 13): a save's work carries
the ticket it took when acknowledged, so under overload an older save's last steps
go before a newer save's writes. Synchronised on events, never on sleeps."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from ckptd.daemon.io import IoPool
from ckptd.daemon.local.shm import SharedMapping

SIZE = 2**20


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


def test_an_idle_thread_keeps_nothing_of_its_last_job(tmp_path: Path) -> None:
    # A job's arguments are often views of a shared-memory segment: while an idle
    # thread kept them, the segment could not be unmapped (its pages stayed held
    # after the pool removed it, outside the staging budget).
    path = tmp_path / "segment"
    path.write_bytes(bytes(SIZE))
    mapping = SharedMapping.open(path, SIZE)
    pool = IoPool(2)
    view = mapping.view(0, SIZE)
    assert pool.submit(len, view).result(timeout=30) == SIZE
    del view
    deadline = time.monotonic() + 30
    while mapping.in_use() and time.monotonic() < deadline:
        time.sleep(0.01)  # the thread drops it right after it set the result
    assert not mapping.in_use(), "the idle I/O thread still holds its last job's view"
    assert mapping.close()
    pool.close()
