"""ckptd.client.ahead without a daemon: a save that asks for its own lease (a
process's first) waits for the reservation in flight, so the two never each have a
segment made where one was needed."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptd.client.ahead import Reserver


class Handoff:
    """Records the daemon calls in order (what Reserver.acquire reaches)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def acquire(self, size: int, wait: float, what: str, rank: int, reuse: bool) -> Any:
        self.calls.append("save's lease")
        return None, None


def test_a_first_save_waits_for_the_reservation_in_flight() -> None:
    handoff = Handoff()
    release = threading.Event()
    with ThreadPoolExecutor(1) as executor:
        reserver = Reserver(handoff, 0, executor)  # type: ignore[arg-type]

        def reservation(*_: Any) -> int:  # what Reserver._run does: leases, then back
            assert release.wait(60)
            handoff.calls.append("reservation done")
            return 2

        reserver._run = reservation  # type: ignore[method-assign]
        reserver.reserve(4 << 20)
        save = threading.Thread(target=reserver.acquire, args=(4 << 20, 1.0, "save", False))
        save.start()
        save.join(0.2)  # bounded: it must still be waiting, whatever the machine's speed
        assert save.is_alive() and handoff.calls == []
        release.set()
        save.join(60)
    assert handoff.calls == ["reservation done", "save's lease"]


def test_with_no_reservation_a_save_asks_at_once() -> None:
    handoff = Handoff()
    with ThreadPoolExecutor(1) as executor:
        Reserver(handoff, 0, executor).acquire(4 << 20, 1.0, "save", False)  # type: ignore[arg-type]
    assert handoff.calls == ["save's lease"]
