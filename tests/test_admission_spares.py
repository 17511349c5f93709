"""Evictions on a small disk of the test's own: the space an eviction frees is there
when it is wanted, even where the evicted step's file would otherwise be kept as a
spare (a file later saves overwrite in place, which frees nothing)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client import CapacityExhausted
from ckptd.daemon.app.launcher import event_is
from ckptd.proto import ckptd_pb2 as pb

from .conftest import RemoteTarget
from .helpers import own_tmpfs
from .test_remote_tier import remote_daemon

MiB = 2**20


@pytest.fixture
def tmpfs_64m(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs, so its free space is known and nothing else on the machine
    writes there. Unmounted after the daemon on it stopped (fixtures tear down in
    reverse: make_daemon, requested after this one, stops first)."""
    with own_tmpfs(tmp_path / "tmpfs", "64m") as mnt:
        yield mnt


def state(step: int) -> dict[str, np.ndarray]:
    """12 MiB that name their step."""
    return {"w": np.full(12 * MiB // 8, step, np.float64)}


def test_back_to_back_saves_get_the_space_their_admission_evicts(
    tmpfs_64m: Path, make_daemon: Any, tmp_path: Path
) -> None:
    """64 MiB disk, 12 MiB saves, 29 MiB floor: a save needs 41 MiB free, which there is
    with one step on disk and not with two. The background evictor is held in a bucket
    deletion (a failpoint), so the local eviction a save needs happens inside that
    save's admission; the save must get the space at once, not find it parked in a
    spare file and be refused until someone retries."""
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon = remote_daemon(
        make_daemon,
        remote,
        failpoints="evict.remote_marker_gone=pause",
        root=tmpfs_64m / "root",
        extra_args=[
            "--retention-local",
            "KeepLatest(1)",
            "--retention-remote",
            "KeepLatest(1)",
            "--local-floor",
            "29MiB",
            "--local-low-watermark",
            "0%",
        ],
    )
    client = daemon.client("spares")
    client.save(1, state(1)).wait("durable", 60)
    client.save(2, state(2)).wait("durable", 60)
    # Step 2 in the bucket: the evictor evicted step 1's local copy (its file kept as a
    # spare) and is now held deleting step 1 from the bucket; it evicts nothing more.
    daemon.wait_failpoint("evict.remote_marker_gone")
    try:
        client.save(3, state(3)).wait("local", 60)  # admitted once the spare is dropped
        # Steps 2 and 3 on disk: too little free until admission's own pass evicts
        # step 2 (in the bucket already), whose space this save needs.
        client.save(4, state(4)).wait("local", 60)
        evicted = daemon.events_of(pb.STEP_EVENT_EVICTED_LOCAL, "spares")
        assert sorted(e.step for e in evicted) == [1, 2]
        tree, _ = client.restore(step=4)
        assert tree["w"].tobytes() == state(4)["w"].tobytes()
    finally:
        daemon.release("evict.remote_marker_gone")


def test_low_watermark_evicts_only_what_brings_free_space_back(
    tmpfs_64m: Path, make_daemon: Any, tmp_path: Path
) -> None:
    """64 MiB disk, 12 MiB saves, low watermark 30 MiB: with three steps on disk free
    space is below the mark and evicting the oldest (in the bucket) is enough. Keeping
    its file as a spare would leave free space where it was and evict the next step
    too, for nothing."""
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon = remote_daemon(
        make_daemon,
        remote,
        root=tmpfs_64m / "root",
        extra_args=[
            "--retention-local",
            "KeepAll()",
            "--retention-remote",
            "KeepAll()",
            "--local-floor",
            "0",
            "--local-low-watermark",
            "30MiB",
        ],
    )
    client = daemon.client("mark")
    client.save(1, state(1)).wait("durable", 60)
    client.save(2, state(2)).wait("durable", 60)
    client.save(3, state(3)).wait("local", 60)  # below the mark now
    daemon.wait_event(event_is(pb.STEP_EVENT_EVICTED_LOCAL, 1), job="mark")
    # A save that can never fit: admission runs its own local pass, which waits for
    # the evictor's running one; once refused, that pass is over.
    with pytest.raises(CapacityExhausted):
        client.save(4, {"w": np.zeros(128 * MiB // 8)})
    evicted = daemon.events_of(pb.STEP_EVENT_EVICTED_LOCAL, "mark")
    assert [e.step for e in evicted] == [1]
    assert sorted(int(p.name) for p in (daemon.root / "mark").iterdir()) == [2, 3]
