"""A job's steps reach LOCAL in the order their saves were acknowledged (issue 13).

Two steps' writes share the disk at once; without the ordering a newer save that
finished writing first would be LOCAL while an older acknowledged one is still in
flight. Synchronised on a failpoint that holds the older write and on the newer
step's status (its rank written), never on sleeps.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ckptd.client.handle import SaveHandle
from ckptd.daemon.app.launcher import event_is
from ckptd.proto import ckptd_pb2 as pb

from .conftest import Daemon


def _status(daemon: Daemon, job: str, step: int) -> pb.SaveStatus:
    req = pb.GetSaveStatusRequest(job=job, step=step)
    status: pb.SaveStatus = daemon.connection.get_save_status(req)
    return status


def test_newer_step_waits_for_the_older_acknowledged_one(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=pause"})
    client = daemon.client("order")
    client.save(1, {"w": np.arange(1 << 16, dtype=np.float32)})
    daemon.wait_failpoint("write.begin")  # step 1 is acknowledged; its write is held
    client.save(2, {"w": np.ones(8, np.float32)})
    # Acknowledged, and waiting for its turn: one step of a job is written at a time.
    newer = _status(daemon, "order", 2)
    assert newer.state == pb.SAVE_STATE_STAGING and not newer.ranks_committed, newer
    assert _status(daemon, "order", 1).state == pb.SAVE_STATE_STAGING
    daemon.release("write.begin")
    SaveHandle(client, 2).wait("local", timeout=60)
    first, second = _status(daemon, "order", 1), _status(daemon, "order", 2)
    assert first.state == second.state == pb.SAVE_STATE_LOCAL
    local = [c.step for c in client.list() if c.state == "LOCAL"]
    assert sorted(local) == [1, 2]
    tree, _ = client.restore(step=1)
    assert tree["w"].tobytes() == np.arange(1 << 16, dtype=np.float32).tobytes()


def test_other_jobs_and_steps_missing_ranks_do_not_hold_a_step_back(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=pause"})
    # Job "held": its write is paused; job "free" must still reach LOCAL.
    daemon.client("held").save(1, {"w": np.zeros(4)})
    daemon.wait_failpoint("write.begin")
    daemon.client("free").save(1, {"w": np.zeros(4)}).wait("local", timeout=60)
    # Job "two": step 1 waits for rank 1, which never hands off; step 2 (both ranks)
    # is not held behind it.
    r0 = daemon.client("two", rank=0, node_ranks=[0, 1])
    r1 = daemon.client("two", rank=1, node_ranks=[0, 1])
    r0.save(1, {"w": np.zeros(4)})
    r0.save(2, {"w": np.ones(4)})
    r1.save(2, {"w": np.ones(4)}).wait("local", timeout=60)
    assert _status(daemon, "two", 1).state == pb.SAVE_STATE_STAGING
    daemon.release("write.begin")
    daemon.client("held").list()
    SaveHandle(daemon.client("held"), 1).wait("local", timeout=60)


def test_a_copy_evicted_under_a_restore_is_not_reported_corrupt(make_daemon: Any) -> None:
    # The evictor chose step 1 and renamed it away, but the catalog still lists it
    # LOCAL (held at evict.renamed) when a restore chooses it: the restore finds its
    # files gone. That is an eviction: a clean "not found" for the step asked for,
    # and no copy set aside as corrupt.
    from ckptd.client import CheckpointNotFound

    daemon: Daemon = make_daemon(
        env={"CKPTD_FAILPOINTS": "evict.renamed=pause,restore.open=pause"},
        extra_args=["--retention-local", "KeepLatest(1)"],
    )
    client = daemon.client("race")
    client.save(1, {"w": np.arange(64, dtype=np.float32)}).wait("local")
    client.save(2, {"w": np.ones(64, np.float32)}).wait("local")
    daemon.wait_failpoint("evict.renamed")  # step 1 renamed away, still listed LOCAL
    outcome: list[BaseException | None] = []

    def restore() -> None:
        try:
            client.restore(step=1)
            outcome.append(None)
        except BaseException as exc:  # the assertion below reports it
            outcome.append(exc)

    reader = threading.Thread(target=restore)
    reader.start()
    daemon.wait_failpoint("restore.open")  # chosen and marked served, not yet opened
    daemon.release("restore.open")
    daemon.release("evict.renamed")
    reader.join(60)
    daemon.wait_event(event_is(pb.STEP_EVENT_EVICTED_LOCAL, 1), job="race")
    assert len(outcome) == 1 and isinstance(outcome[0], CheckpointNotFound), outcome
    # The step's absence, not a file-system error from a path it was reading.
    assert "no save of step 1" in str(outcome[0]), outcome
    assert not daemon.events_of(pb.STEP_EVENT_SET_ASIDE, "race")
    tree, _ = client.restore()
    assert tree["w"].tobytes() == np.ones(64, np.float32).tobytes()
