"""A job's own retention, set by its trainer (retention/jobs.py), against real daemons
and a file:// bucket: it replaces the node's policies in every tier, within the
operator's limits, and outlives a daemon restart and a lost node."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ckptd.client import Client
from ckptd.core.errors import FailedPrecondition, InvalidArgument
from ckptd.proto import ckptd_pb2 as pb

from .conftest import CKPTD, Daemon, RemoteTarget
from .test_remote_tier import remote_daemon
from .test_retention_tier import settled, small

NODE = ["--retention-local", "KeepLatest(2)", "--retention-remote", "KeepLatest(2)"]


def bucket(tmp_path: Path, name: str = "bucket") -> RemoteTarget:
    return RemoteTarget("file", f"file://{tmp_path}/{name}", {})


def save_durable(client: Client, steps: range, **kw: Any) -> None:
    for step in steps:
        client.save(step, small(step), **kw).wait("durable", 60)


def test_the_jobs_policy_replaces_the_nodes_in_every_tier(make_daemon: Any, tmp_path: Path) -> None:
    d: Daemon = remote_daemon(make_daemon, bucket(tmp_path), extra_args=NODE)
    client = d.client("own")
    local, remote = client.set_retention("KeepAny([KeepLatest(4), KeepEverySteps(5)])")
    # The bucket keeps the job's policy; the disk what both the node and the job keep.
    assert remote == "KeepAny([KeepAny([KeepLatest(4), KeepEverySteps(5)]), KeepMilestones()])"
    assert local.startswith("KeepBoth(KeepLatest(2), ")
    save_durable(client, range(1, 12))
    settled(client, [10, 11], [5, 8, 9, 10, 11])
    other = d.client("node")  # a job that set nothing keeps the node's policies
    save_durable(other, range(1, 5))
    settled(other, [3, 4], [3, 4])
    # A narrower policy removes what it no longer keeps, from the bucket too.
    client.set_retention("KeepBest('loss', 1)")
    save_durable(client, range(12, 15), metrics={"loss": 0.5})
    client.save(15, small(15), metrics={"loss": 0.1}).wait("durable", 60)
    client.save(16, small(16), metrics={"loss": 0.9}).wait("durable", 60)
    settled(client, [15, 16], [15, 16])  # the best, and the newest (always kept)
    # "" (None) gives the node's policies back.
    assert client.set_retention(None) == ("KeepLatest(2)", "KeepLatest(2)")
    client.save(17, small(17)).wait("durable", 60)
    settled(client, [16, 17], [16, 17])
    out = subprocess.run([CKPTD, "ls", "own", "--socket", str(d.socket)], capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert "17" in out.stdout


def test_it_outlives_a_restart_and_a_lost_node(make_daemon: Any, tmp_path: Path) -> None:
    d: Daemon = remote_daemon(make_daemon, bucket(tmp_path), extra_args=NODE)
    client = d.client("kept")
    client.set_retention("KeepLatest(5)")
    save_durable(client, range(1, 7))
    settled(client, [5, 6], [2, 3, 4, 5, 6])
    assert len(list((tmp_path / "bucket" / "kept" / "_retention").glob("*.json"))) == 1
    d.stop()
    d.start()  # no trainer has said anything since: the daemon's record holds
    save_durable(client, range(7, 8))
    settled(client, [6, 7], [3, 4, 5, 6, 7])
    # The node is lost: a fresh daemon on an empty disk finds the steps in the bucket
    # and the job's policy beside them, before any trainer connects.
    d.kill()
    shutil.rmtree(d.root)
    fresh: Daemon = remote_daemon(make_daemon, bucket(tmp_path), extra_args=NODE)
    client = fresh.client("kept")
    save_durable(client, range(8, 9))  # the evictor passes after each DURABLE
    settled(client, [8], [4, 5, 6, 7, 8])
    assert fresh.events_of(pb.STEP_EVENT_EVICTED_REMOTE, "kept")[0].step == 3


def test_the_operators_limits(make_daemon: Any, tmp_path: Path) -> None:
    off: Daemon = make_daemon(extra_args=["--no-job-retention"])
    with pytest.raises(FailedPrecondition, match="job_retention = false"):
        off.client("j").set_retention("KeepLatest(9)")
    off.client("j").set_retention(None)  # the node's policy: always allowed
    capped: Daemon = make_daemon(
        extra_args=["--job-retention-max-steps", "3", "--job-retention-floor", "KeepSteps([1])"]
    )
    client = capped.client("j")
    local, remote = client.set_retention("KeepAll()")
    assert (
        local == ("KeepAny([KeepAtMost(KeepAll(), 3), KeepMilestones(), KeepSteps([1])])")
        and remote == ""
    )
    for step in range(1, 7):
        client.save(step, small(step)).wait("local", 60)
    settled(client, [1, 4, 5, 6], [])  # the operator's floor keeps step 1 too
    with pytest.raises(InvalidArgument, match="unknown policy 'KeepForever'"):
        client.set_retention("KeepForever()")
