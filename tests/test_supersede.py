"""Saves faster than the disk: the newest acknowledged save takes the place of an
older one whose write has not begun, and a restore of the newest step finds what
was acknowledged last.

Synchronised on failpoints that hold the first write (``write.begin``) and mark a
restore waiting for a save in flight (``restore.in_flight``), and on step events,
never on sleeps.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from ckptd.client import SaveFailed
from ckptd.daemon.app.launcher import event_is
from ckptd.proto import ckptd_pb2 as pb

from .conftest import Daemon
from .helpers import reservations_done
from .test_metrics import scrape, value


def _tree(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(1 << 14, step, np.float32), "b": np.arange(step + 3, dtype=np.int64)}


KEEP = ["--retention-local", "KeepLatest(10)"]  # every step stays: the listing is the answer


def _local(client: Any) -> list[int]:
    return sorted(c.step for c in client.list() if c.state == "LOCAL")


def test_a_newer_save_takes_the_place_of_one_not_yet_written(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=pause"}, extra_args=KEEP)
    client = daemon.client("fast", supersede=True)
    first = client.save(1, _tree(1))
    daemon.wait_failpoint("write.begin")  # step 1 is being written, and held
    second = client.save(2, _tree(2))
    third = client.save(3, _tree(3))
    daemon.wait_event(event_is(pb.STEP_EVENT_SUPERSEDED, 2), job="fast")
    with pytest.raises(SaveFailed) as failed:
        second.wait("local", timeout=60)
    assert failed.value.code == "SUPERSEDED" and "step 3" in str(failed.value)
    assert second.state() == "SUPERSEDED"  # the status answers after it left the table
    daemon.release("write.begin")
    first.wait("local", timeout=60)
    third.wait("local", timeout=60)
    assert _local(client) == [1, 3]  # step 2 is nowhere: no record, no files
    assert not (daemon.root / "fast" / "2").exists()
    tree, _ = client.restore()
    assert client.latest_step() == 3 and tree["w"].tobytes() == _tree(3)["w"].tobytes()
    # Its memory came back: no lease is held once the saves are LOCAL.
    reservations_done(client)
    assert daemon.status().leases_held == 0
    saves = scrape(daemon)
    assert value(saves, "ckptd_saves_total", result="superseded") == 1
    assert value(saves, "ckptd_saves_total", result="failed") == 0
    # A new save under the superseded number is an ordinary save.
    client.save(2, _tree(2)).wait("local", timeout=60)


def test_milestones_and_the_opt_out_are_written(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=pause"}, extra_args=KEEP)
    client = daemon.client("kept", supersede=True)
    client.save(1, _tree(1))
    daemon.wait_failpoint("write.begin")
    milestone = client.save(2, _tree(2), milestone=True)
    plain = client.save(3, _tree(3))
    last = client.save(4, _tree(4))
    daemon.wait_event(event_is(pb.STEP_EVENT_SUPERSEDED, 3), job="kept")
    daemon.release("write.begin")
    milestone.wait("local", timeout=60)
    last.wait("local", timeout=60)
    with pytest.raises(SaveFailed):
        plain.wait("local", timeout=60)
    assert _local(client) == [1, 2, 4]
    # A client that does not ask for it (a framework's integration, or any client
    # whose policy does not save every step) has every save written.
    held: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=pause"}, extra_args=KEEP)
    _all_written(held, held.client("named", supersede=False))
    off: Daemon = make_daemon(
        env={"CKPTD_FAILPOINTS": "write.begin=pause"},
        extra_args=[*KEEP, "--no-supersede-unwritten"],
    )
    _all_written(off, off.client("every", supersede=True))


def _all_written(daemon: Daemon, client: Any) -> None:
    """Saves 2-4 arrive while step 1's write is held; every one of them is written."""
    client.save(1, _tree(1))
    daemon.wait_failpoint("write.begin")
    handles = [client.save(s, _tree(s)) for s in (2, 3, 4)]
    daemon.release("write.begin")
    for h in handles:
        h.wait("local", timeout=60)
    assert _local(client) == [1, 2, 3, 4]
    assert not daemon.events_of(pb.STEP_EVENT_SUPERSEDED, client.job)


def test_a_restore_of_the_newest_step_waits_for_the_save_in_flight(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon(
        env={"CKPTD_FAILPOINTS": "write.begin=pause,restore.in_flight=pause"}
    )
    trainer = daemon.client("crashy")
    trainer.save(1, _tree(1))
    daemon.wait_failpoint("write.begin")  # acknowledged, its write held: not LOCAL
    restarted = daemon.client("crashy")
    got: list[Any] = []

    def restore() -> None:
        try:
            got.append(restarted.restore())
        except BaseException as exc:  # the assertion below reports it
            got.append(exc)

    reader = threading.Thread(target=restore)
    reader.start()
    daemon.wait_failpoint("restore.in_flight")  # the restore waits for step 1
    daemon.release("restore.in_flight")
    daemon.release("write.begin")
    reader.join(60)
    assert len(got) == 1 and not isinstance(got[0], BaseException), got
    tree, _ = got[0]
    assert tree["w"].tobytes() == _tree(1)["w"].tobytes()


def test_a_daemon_crash_keeps_the_newest_acknowledged_save(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=pause"}, extra_args=KEEP)
    client = daemon.client("kept-newest", supersede=True)
    client.save(1, _tree(1))
    daemon.wait_failpoint("write.begin")  # step 1 is being written, and held
    for step in (2, 3, 4):
        client.save(step, _tree(step))
    daemon.wait_event(event_is(pb.STEP_EVENT_SUPERSEDED, 3), job="kept-newest")
    daemon.kill()  # steps 1 and 4 acknowledged and not written; 2 and 3 superseded
    daemon.env = {}
    daemon.restart()  # replays the journal from shared memory
    tree, _ = daemon.client("kept-newest").restore()
    assert tree["w"].tobytes() == _tree(4)["w"].tobytes()
    assert _local(client) == [1, 4]
