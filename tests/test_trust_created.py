"""After a node loss, the steps only the bucket holds keep their real creation times in
``Client.list()`` and ``ckptd ls`` (from the node's index, or a replacement node's
read of the markers), never 1970-01-01."""

from __future__ import annotations

import shutil
import subprocess
import time
from typing import Any

import numpy as np

from .conftest import CKPTD, Daemon, RemoteTarget


def _saved_and_wiped(make_daemon: Any, tmp_path: Any) -> tuple[Daemon, dict[int, float]]:
    """A daemon that saved steps 1 and 2 to a file:// bucket, stopped, its local tier
    wiped (the node's disk lost): the creation time of each step as listed before."""
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon: Daemon = make_daemon(extra_args=["--remote", remote.url])
    client = daemon.client("lost")
    for step in (1, 2):
        client.save(step, {"w": np.full(64, step, np.float32)}).wait("durable", 120)
    before = {c.step: c.created_unix for c in client.list()}
    assert all(t > 1e9 for t in before.values()), before
    client.close()
    assert daemon.stop() == 0
    shutil.rmtree(daemon.root)
    return daemon, before


def _ls_times(daemon: Daemon) -> list[str]:
    out = subprocess.run(
        [CKPTD, "ls", "lost", "--socket", str(daemon.socket)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:] if line.startswith("lost")]
    # JOB STEP STATE TIERS SIZE SHARDS DATE TIME ...
    return [f"{r[6]} {r[7]}" for r in rows]


def _local(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def test_bucket_only_steps_keep_their_creation_time_after_a_wiped_disk(
    make_daemon: Any, tmp_path: Any
) -> None:
    daemon, before = _saved_and_wiped(make_daemon, tmp_path)
    daemon.restart()
    client = daemon.client("lost")
    rows = client.list()
    assert [(c.step, c.tiers) for c in rows] == [(2, ("REMOTE",)), (1, ("REMOTE",))]
    assert {c.step: c.created_unix for c in rows} == before
    assert _ls_times(daemon) == [_local(before[2]), _local(before[1])]


def test_a_replacement_node_reads_the_creation_time_from_the_markers(
    make_daemon: Any, tmp_path: Any
) -> None:
    daemon, before = _saved_and_wiped(make_daemon, tmp_path)
    daemon.node_id = "replacement"  # a new node: no index of its own in the bucket
    daemon.restart()
    rows = daemon.client("lost").list()
    assert {c.step for c in rows} == {1, 2} and all(c.tiers == ("REMOTE",) for c in rows)
    assert {c.step: c.created_unix for c in rows} == before
    assert "1970" not in " ".join(_ls_times(daemon))
