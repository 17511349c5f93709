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

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

import torch

from ckptd.client import SaveHandle
from ckptd.proto import ckptd_pb2 as pb

from ..conftest import Daemon, RemoteTarget
from ..test_remote_tier import remote_daemon
from .test_deepspeed import assert_same

WORKER = Path(__file__).with_name("accelerate_worker.py")
REPO = Path(__file__).resolve().parents[2]
JOB = "acc"


def start(
    d: Daemon, project: Path, out: Path, *extra: str, job: str = JOB
) -> list[subprocess.Popen[str]]:
    """The worker as 2 processes (gloo), as torchrun or ``accelerate launch`` would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}  # fmt: skip
    command = [sys.executable, str(WORKER), str(d.socket), job, str(project), str(out)]
    return [
        subprocess.Popen(
            [*command, "--total-limit", "2", *extra],
            cwd=REPO,
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]


def finish(procs: list[subprocess.Popen[str]], out: Path) -> list[dict[str, Any]]:
    """Wait for the workers; what each wrote (fails with their output if one failed)."""
    logs = []
    for p in procs:
        try:
            log, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            log, _ = p.communicate()
        logs.append(log)
    for p in procs:
        assert p.returncode == 0, "\n".join(log[-6000:] for log in logs)
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]


def kill_when_held(procs: list[subprocess.Popen[str]], out: Path) -> None:
    """Wait until both workers' ``save_state`` of the kill step returned, then make sure
    both are gone (each kills itself)."""
    held = [Path(f"{out}.held{rank}") for rank in (0, 1)]
    t0 = time.monotonic()
    while not all(h.exists() for h in held):
        done = [p for p in procs if p.poll() is not None and p.returncode != -signal.SIGKILL]
        assert not done, done[0].communicate()[0][-6000:]
        assert time.monotonic() - t0 < 300, "the workers never reached the kill step"
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)


def state(out: Path) -> list[Any]:
    return [torch.load(f"{out}.{rank}.pt", weights_only=False) for rank in (0, 1)]


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
