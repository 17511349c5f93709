"""Retention, watermarks, pins and backpressure against real daemons and real S3."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client import CapacityExhausted, Client, Continuous, FixedInterval
from ckptd.proto import ckptd_pb2 as pb

from .conftest import CKPTD, Daemon, RemoteTarget
from .helpers import own_tmpfs
from .test_remote_tier import expected_layout, remote_daemon, s3_target

LOCAL2 = ["--retention-local", "KeepLatest(2)"]
REMOTE_3_10 = ["--retention-remote", "KeepAny([KeepLatest(3), KeepEverySteps(10)])"]


def settled(client: Client, local: list[int], remote: list[int], timeout: float = 60.0) -> None:
    """Wait until the local and remote tiers hold exactly these steps (the evictor runs
    in the background); fail with what they hold."""
    deadline = time.monotonic() + timeout
    while True:
        rows = client.list()
        got_local = sorted(c.step for c in rows if "LOCAL" in c.tiers)
        got_remote = sorted(c.step for c in rows if "REMOTE" in c.tiers)
        if (got_local, got_remote) == (local, remote):
            return
        assert time.monotonic() < deadline, f"local {got_local}, remote {got_remote}"
        time.sleep(0.1)


def local_dirs(daemon: Daemon, job: str) -> list[int]:
    return sorted(int(p.name) for p in (daemon.root / job).iterdir())


def bucket_steps(remote: RemoteTarget, job: str) -> list[int]:
    keys = [k.split("/") for k in remote.object_keys() if k.startswith(job + "/")]
    return sorted({int(k[1]) for k in keys if k[1].isdigit()})


def small(step: int) -> dict[str, Any]:
    return {"x": np.full(1000, step, dtype=np.int64)}


def test_25_durable_saves_keep_exactly_what_the_policies_say(
    make_daemon: Any, s3_server: Any
) -> None:
    remote = s3_target(s3_server, "ckptd-ret25")
    daemon = remote_daemon(make_daemon, remote, extra_args=LOCAL2 + REMOTE_3_10)
    client = daemon.client("r25")
    for step in range(25):
        client.save(step, small(step)).wait("durable", 60)
    settled(client, [23, 24], [0, 10, 20, 22, 23, 24])
    assert local_dirs(daemon, "r25") == [23, 24]
    assert remote.object_keys() == expected_layout("r25", [0, 10, 20, 22, 23, 24])
    why = {c.step: (c.local_reasons, c.remote_reasons) for c in client.list()}
    assert why[20] == ((), ("every-10-steps",))
    assert why[22] == ((), ("latest",))
    assert why[24] == (("latest", "newest"), ("latest", "newest"))
    out = subprocess.run(
        [CKPTD, "ls", "r25", "--socket", str(daemon.socket)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "KEPT BY" in out.stdout and "remote=every-10-steps" in out.stdout
    row_24 = next(line for line in out.stdout.splitlines() if line.split()[1] == "24")
    assert "local=latest,newest remote=latest,newest" in row_24
    # The evicted steps are gone for restore too; the kept ones restore.
    tree, _ = client.restore(step=10)
    assert tree["x"][0] == 10


def test_coalescing_drain_still_uploads_what_the_bucket_keeps(
    make_daemon: Any, s3_server: Any
) -> None:
    remote = s3_target(s3_server, "ckptd-retco")
    daemon = remote_daemon(
        make_daemon,
        remote,
        "drain.before_marker=pause",
        extra_args=["--retention-local", "KeepAll()", *REMOTE_3_10],
    )
    client = daemon.client("rco")
    handles = [client.save(0, small(0))]
    daemon.wait_failpoint("drain.before_marker")  # step 0 is held at its marker...
    handles += [client.save(step, small(step)) for step in range(1, 25)]  # ...while 1..24 come
    for h in handles:
        h.wait("local", 60)
    daemon.release("drain.before_marker")
    handles[-1].wait("durable", 120)
    settled(client, list(range(25)), [0, 10, 20, 22, 23, 24], timeout=120)
    assert remote.object_keys() == expected_layout("rco", [0, 10, 20, 22, 23, 24])
    states = {c.step: c.state for c in client.list()}
    assert {states[s] for s in (0, 10, 20, 22, 23, 24)} == {"DURABLE"}
    # Coalesced: only what the bucket keeps went up, the newest first after step 0.
    uploaded = [e.step for e in daemon.events_of(pb.STEP_EVENT_DURABLE, "rco")]
    assert uploaded == [0, 24, 23, 22, 20, 10]
    assert {states[s] for s in set(range(25)) - set(uploaded)} == {"SUPERSEDED"}


@pytest.fixture
def own_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 MiB filesystem of the test's own (tmpfs), so its free space is known and no
    other process on the machine changes it. Unmounted after the daemons stopped."""
    with own_tmpfs(tmp_path / "own-disk", "512m") as path:
        yield path


def test_floor_refuses_saves_and_keeps_serving(own_disk: Path, make_daemon: Any) -> None:
    size = 200 * 2**20
    root = own_disk / "root"
    st = os.statvfs(own_disk)
    free = st.f_bavail * st.f_frsize  # 512 MiB, and nothing else writes here
    floor = free - size * 3 // 2  # one save fits, a second does not (100 MiB margins)
    daemon = make_daemon(
        root=root, extra_args=["--retention-local", "KeepAll()", "--local-floor", str(floor)]
    )
    client = daemon.client("floor", policy=FixedInterval(1))
    big = {"w": np.arange(size // 8, dtype=np.float64)}
    client.save(1, big).wait("local", 60)
    with pytest.raises(CapacityExhausted, match=r"short.*local_floor") as info:
        client.save(2, big)
    assert "retention_local" in str(info.value)
    assert client.should_save(3) is False and "floor" in client.last_refusal
    assert [(c.step, c.state) for c in client.list()] == [(1, "LOCAL")]
    tree, _ = client.restore(step=1)
    assert np.array_equal(tree["w"], big["w"])
    client.save(4, small(4)).wait("local", 30)  # a save that fits still goes through
    assert sorted(c.step for c in client.list()) == [1, 4]
    assert daemon.proc is not None and daemon.proc.poll() is None


def test_low_watermark_evicts_uploaded_copies(make_daemon: Any, tmp_path: Path) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon = remote_daemon(
        make_daemon,
        remote,
        extra_args=[
            "--retention-local",
            "KeepAll()",
            "--retention-remote",
            "KeepAll()",
            "--local-low-watermark",
            "100%",
        ],
    )
    client = daemon.client("low")
    for step in range(5):
        client.save(step, small(step)).wait("durable", 60)
    settled(client, [4], [0, 1, 2, 3, 4])  # always below the mark: only the newest stays
    evicted = daemon.events_of(pb.STEP_EVENT_EVICTED_LOCAL, "low")
    assert {e.step for e in evicted} == {0, 1, 2, 3}
    assert all("below the low watermark" in e.detail for e in evicted)


@pytest.mark.parametrize("with_remote", [False, True])
def test_newest_survives_keep_latest_zero(
    make_daemon: Any, tmp_path: Path, with_remote: bool
) -> None:
    args = ["--retention-local", "KeepLatest(0)", "--retention-remote", "KeepLatest(0)"]
    if with_remote:
        remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
        daemon = remote_daemon(make_daemon, remote, extra_args=args)
    else:
        daemon = make_daemon(extra_args=args)
    client = daemon.client("zero")
    for step in range(4):
        client.save(step, small(step)).wait("durable" if with_remote else "local", 60)
    settled(client, [3], [3] if with_remote else [])
    assert client.restore()[0]["x"][0] == 3
    daemon.stop()
    daemon.start()  # a restart applies the policy to what it finds: the newest stays
    assert client.restore()[0]["x"][0] == 3
    assert local_dirs(daemon, "zero") == [3]


def test_pins_survive_retention_and_restarts(make_daemon: Any, tmp_path: Path) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    args = ["--retention-local", "KeepLatest(1)", "--retention-remote", "KeepLatest(1)"]
    daemon = remote_daemon(make_daemon, remote, extra_args=args)
    client = daemon.client("pin")
    client.save(1, small(1)).wait("durable", 60)
    out = subprocess.run(
        [CKPTD, "pin", "pin", "1", "--socket", str(daemon.socket)], capture_output=True, text=True
    )
    assert out.returncode == 0 and "pinned" in out.stdout, out.stderr
    for step in (2, 3):
        client.save(step, small(step)).wait("durable", 60)
    settled(client, [1, 3], [1, 3])
    assert "pin/1/_pinned" in remote.object_keys()
    assert next(c for c in client.list() if c.step == 1).pinned
    daemon.stop()
    daemon.start()
    client.save(4, small(4)).wait("durable", 60)
    settled(client, [1, 4], [1, 4])
    client.unpin(1)
    settled(client, [4], [4])
    assert "pin/1/_pinned" not in remote.object_keys()
    out = subprocess.run(
        [CKPTD, "pin", "pin", "99", "--socket", str(daemon.socket)], capture_output=True, text=True
    )
    assert out.returncode == 2 and "no save of step 99" in out.stderr


def test_keep_best_uses_metrics_even_after_the_local_copy_is_gone(
    make_daemon: Any, tmp_path: Path
) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    args = ["--retention-local", "KeepLatest(1)", "--retention-remote", "KeepBest('loss', 1)"]
    daemon = remote_daemon(make_daemon, remote, extra_args=args)
    client = daemon.client("best")
    losses = [3.0, 0.5, 2.0, 1.0, 4.0]
    for step, loss in enumerate(losses):
        client.save(step, small(step), metrics={"loss": loss}).wait("durable", 60)
    settled(client, [4], [1, 4])
    assert next(c for c in client.list() if c.step == 1).remote_reasons == ("best-loss",)
    daemon.stop()
    daemon.start()  # step 1 is only in the bucket: its marker carries the metric
    client.save(5, small(5), metrics={"loss": 0.9}).wait("durable", 60)
    settled(client, [5], [1, 5])
    with pytest.raises(TypeError, match="not a number"):
        client.save(6, small(6), metrics={"loss": "low"})  # type: ignore[dict-item]


def test_staging_backpressure(make_daemon: Any) -> None:
    daemon = make_daemon(
        extra_args=["--staging-budget-bytes", "24MiB"],
        env={"CKPTD_FAILPOINTS": "write.begin=pause"},
    )
    client = daemon.client("bp", policy=FixedInterval(1))
    state = {"w": np.ones(16 * 2**20 // 8)}  # 16 MiB: one lease holds most of the budget
    first = client.save(1, state)
    daemon.wait_failpoint("write.begin")  # step 1's lease stays held until released
    assert client.should_save(2) is False and "staging memory" in client.last_refusal
    with pytest.raises(CapacityExhausted, match="staging budget exhausted"):
        client.save(2, state, staging_timeout=0.5)
    # With time to wait, the save goes through once step 1's write returns its lease.
    with ThreadPoolExecutor(1) as pool:
        third = pool.submit(client.save, 3, state, staging_timeout=30)
        daemon.release("write.begin")
        third.result(60).wait("local", 30)
    first.wait("local", 30)
    assert [c.step for c in client.list()] == [3, 1]


def test_continuous_should_save_follows_the_daemon(make_daemon: Any) -> None:
    daemon = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=pause"})
    client = daemon.client("cont", policy=Continuous())
    assert client.should_save(0) is True  # nothing saved yet
    handle = client.save(0, small(0))
    daemon.wait_failpoint("write.begin")
    assert client.should_save(0) is False  # that step is saved already
    assert client.should_save(1) is False  # step 0 is still being written
    daemon.release("write.begin")
    handle.wait("local", 30)
    deadline = time.monotonic() + 10
    while not client.should_save(2):  # the watcher thread sees LOCAL within moments
        assert time.monotonic() < deadline, "should_save stayed False after LOCAL"
        time.sleep(0.01)
    client.save(2, small(2)).wait("local", 30)
    interval = Client("cont", daemon.socket, policy=Continuous(min_interval_seconds=3600))
    try:
        assert interval.should_save(3) is True
        interval.save(3, small(3)).wait("local", 30)
        assert interval.should_save(4) is False  # LOCAL, but the hour has not passed
    finally:
        interval.close()


def test_a_step_restored_into_shared_memory_is_not_held_back_from_retention(
    make_daemon: Any,
) -> None:
    # Restored into a lease, the client needs none of the step's files: it turns into
    # a spare when retention drops it. Restored as files (shared_memory=False), the
    # client opens them after the reply: the step is kept for a grace period.
    daemon: Daemon = make_daemon(extra_args=["--retention-local", "KeepLatest(1)"])
    client = daemon.client("held")
    client.save(1, small(1)).wait("local")
    tree, _ = client.restore(step=1)
    assert tree["x"][0] == 1
    del tree
    client.save(2, small(2)).wait("local")
    settled(client, [2], [])  # step 1 evicted although it was just restored
    tree, _ = client.restore(step=2, shared_memory=False)
    assert tree["x"][0] == 2
    client.save(3, small(3)).wait("local")
    client.save(4, small(4)).wait("local")
    # Step 3 goes as retention says; step 2 is held for the client that opens its files.
    settled(client, [2, 4], [])
    assert (daemon.root / "held" / "2" / "rank-00000.safetensors").exists()
    del tree
