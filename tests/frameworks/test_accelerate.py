"""HF accelerate's ``save_state`` / ``load_state`` through ckptd
(ckptd.client.accelerate): accelerate's own ``Accelerator`` with automatic checkpoint
naming and ``total_limit``, 2 processes over gloo on CPU
(tests/frameworks/accelerate_worker.py), against a real daemon with a ``file://``
bucket, compared with the same run never interrupted and never through ckptd.

- SIGKILL right after ``save_state`` returned, the same command again: the run
  resumes from that step and ends bit-exact (parameters, optimizer, schedule, RNG),
  with accelerate's folders as the plain run left them (``total_limit`` applied,
  and the next folder not colliding with the loaded one).
- A lost node (the daemon's root and the project folder gone, a fresh daemon on the
  bucket): ``load_state()`` puts the newest folder back from the bucket, bit-exact.
- ``total_limit`` is the job's retention in ckptd's tiers.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")


from ckptd.client import SaveHandle
from ckptd.proto import ckptd_pb2 as pb

from ..conftest import Daemon, RemoteTarget
from ..test_remote_tier import remote_daemon
from . import two_ranks
from .two_ranks import assert_same, finish, kill_when_held, state

WORKER = Path(__file__).with_name("accelerate_worker.py")
JOB = "acc"


def start(
    d: Daemon, project: Path, out: Path, *extra: str, job: str = JOB
) -> list[subprocess.Popen[str]]:
    """The worker as 2 processes (gloo), as torchrun or ``accelerate launch`` would."""
    argv = [str(WORKER), str(d.socket), job, str(project), str(out), "--total-limit", "2"]
    return two_ranks.start([*argv, *extra])


def test_killed_after_save_state_resumes_bit_exact_and_after_node_loss(
    make_daemon: Any, tmp_path: Path
) -> None:
    bucket = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    d: Daemon = remote_daemon(make_daemon, bucket)
    ref = tmp_path / "ref"
    plain = finish(start(d, tmp_path / "plain", ref, "--plain"), ref)
    assert plain[0]["folders"] == ["checkpoint_2", "checkpoint_3"]  # total_limit=2
    want = state(ref)

    project, run = tmp_path / "project", tmp_path / "run"
    kill_when_held(start(d, project, run, "--kill-at", "4"), run)  # checkpoint_1 is step 4
    got = finish(start(d, project, run), run)
    assert [r["start"] for r in got] == [4, 4] and [r["saved"] for r in got] == [[6, 8]] * 2
    assert got[0]["folders"] == plain[0]["folders"]
    assert_same(state(run), want)
    client = d.client(JOB)
    for step in (2, 3):
        SaveHandle(client, step).wait("durable", timeout=120)
    assert {c.step for c in client.list() if c.adopted} >= {2, 3}
    assert "KeepLatest(2)" in (d.root / "job-retention.json").read_text()  # total_limit

    # A lost node: its disk (the daemon's root and the project folder) is gone.
    d.kill()
    shutil.rmtree(d.root)
    shutil.rmtree(project)
    fresh: Daemon = remote_daemon(make_daemon, bucket)
    lost = tmp_path / "lost"
    again = finish(start(fresh, project, lost), lost)  # loads step 8: no training left
    assert [r["start"] for r in again] == [8, 8] and [r["saved"] for r in again] == [[], []]
    assert_same(state(lost), want)
    assert again[0]["folders"] == ["checkpoint_3"]
    assert 3 in [e.step for e in fresh.events_of(pb.STEP_EVENT_FETCHED, JOB)]


def test_a_fresh_start_and_a_run_moving_to_ckptd(make_daemon: Any, tmp_path: Path) -> None:
    """``load_state()`` with nothing anywhere starts fresh (accelerate itself fails on
    an empty folder); a run that saved without ckptd loads its own newest folder."""
    d: Daemon = make_daemon()
    first = tmp_path / "first"
    fresh = finish(start(d, tmp_path / "new", first, "--steps", "2", job="new"), first)
    assert [r["start"] for r in fresh] == [None, None]
    project = tmp_path / "project"
    finish(start(d, project, first, "--plain", "--steps", "4"), first)
    moved = tmp_path / "moved"
    got = finish(start(d, project, moved, "--steps", "6"), moved)
    assert [r["start"] for r in got] == [4, 4] and [r["saved"] for r in got] == [[6]] * 2
    assert got[0]["folders"] == ["checkpoint_1", "checkpoint_2"]
