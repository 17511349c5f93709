"""DeepSpeed through ckptd (ckptd.client.deepspeed): DeepSpeed's own engine,
``save_checkpoint`` and ``load_checkpoint``, ZeRO on 2 processes over gloo on CPU
(tests/frameworks/deepspeed_worker.py), against a real daemon with a ``file://``
bucket, compared with the run that was never interrupted.

- SIGKILL right after ``save_checkpoint`` returned, the same command again: the run
  resumes from that step and ends bit-exact (parameters and optimizer state).
- A lost node (the daemon's root and the checkpoint directory gone, a fresh daemon
  on the bucket): the load writes the references and ``latest`` back and reads the
  step from the bucket, bit-exact.
- The checkpoint directory keeps DeepSpeed's layout, and ``torch.load`` of a file
  there (as ``zero_to_fp32.py`` does) gives the file's state dict.
- A run that saved with DeepSpeed's own engine moves to ckptd: its files load.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

import torch

from ckptd.client import SaveHandle
from ckptd.proto import ckptd_pb2 as pb

from ..conftest import Daemon, RemoteTarget
from ..test_remote_tier import remote_daemon
from . import two_ranks
from .two_ranks import assert_same, finish, kill_when_held, state

WORKER = Path(__file__).with_name("deepspeed_worker.py")
JOB = "ds"


def start(d: Daemon, ckpt: Path, out: Path, *extra: str) -> list[subprocess.Popen[str]]:
    """The worker as 2 processes (gloo), as torchrun would start them."""
    argv = [str(WORKER), str(d.socket), JOB, str(ckpt), str(out), *extra]
    return two_ranks.start(argv, {"CKPTD_SOCKET": str(d.socket)})


def convert(folder: Path, out: Path) -> dict[str, Any]:
    """DeepSpeed's ds_to_universal.py on ``folder``: every output file, loaded."""
    done = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
         str(folder), "--output_folder", str(out), "--inject_missing_state",
         "--num_extract_workers", "2", "--num_merge_workers", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return {
        str(f.relative_to(out)): torch.load(f, weights_only=False)
        for f in sorted(out.rglob("*")) if f.is_file()
    }  # fmt: skip


@pytest.mark.parametrize("stage", [2, 3])
def test_killed_after_a_save_resumes_bit_exact_and_after_node_loss(
    make_daemon: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: int
) -> None:
    bucket = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    d: Daemon = remote_daemon(make_daemon, bucket)
    ref = tmp_path / "ref"
    zero = ("--stage", str(stage))
    plain = finish(start(d, tmp_path / "plain-ckpt", ref, "--plain", *zero), ref)
    assert [r["start"] for r in plain] == [None, None]
    want = state(ref)

    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    kill_when_held(start(d, ckpt, run, "--kill-at", "6", *zero), run)
    assert (ckpt / "global_step6").is_dir()
    got = finish(start(d, ckpt, run, *zero), run)
    assert [r["start"] for r in got] == [6, 6] and [r["saved"] for r in got] == [[8]] * 2
    assert_same(state(run), want)
    # The same files as DeepSpeed's own engine wrote, and torch.load of each (what
    # zero_to_fp32.py and ds_to_universal.py do) gives what that engine's file holds.
    names = sorted(os.listdir(tmp_path / "plain-ckpt" / "global_step8"))
    assert sorted(os.listdir(ckpt / "global_step8")) == names
    monkeypatch.setenv("CKPTD_SOCKET", str(d.socket))
    for name in names:
        ours = torch.load(ckpt / "global_step8" / name, weights_only=False)
        theirs = torch.load(tmp_path / "plain-ckpt" / "global_step8" / name, weights_only=False)
        assert_same(ours, theirs, name)
    if stage == 2:  # Universal Checkpointing's conversion reads the references
        universal = convert(ckpt / "global_step8", tmp_path / "uc")
        assert any("exp_avg" in name for name in universal)
        assert_same(universal, convert(tmp_path / "plain-ckpt" / "global_step8", tmp_path / "p"))

    # A lost node: its disk (the daemon's root and the checkpoint directory) is gone.
    for step in (2, 4, 6, 8):
        SaveHandle(d.client(JOB), step).wait("durable", timeout=120)
    d.kill()
    shutil.rmtree(d.root)
    shutil.rmtree(ckpt)
    fresh: Daemon = remote_daemon(make_daemon, bucket)
    lost = tmp_path / "lost"
    again = finish(start(fresh, ckpt, lost, *zero), lost)  # loads step 8, the last one: no training
    assert [r["start"] for r in again] == [8, 8] and [r["saved"] for r in again] == [[], []]
    assert_same(state(lost), want)
    assert (ckpt / "latest").read_text() == "global_step8"
    assert 8 in [e.step for e in fresh.events_of(pb.STEP_EVENT_FETCHED, JOB)]


def test_a_run_saved_by_deepspeeds_own_engine_moves_to_ckptd(
    make_daemon: Any, tmp_path: Path
) -> None:
    d: Daemon = make_daemon()
    ckpt, first = tmp_path / "ckpt", tmp_path / "first"
    finish(start(d, ckpt, first, "--plain", "--steps", "4"), first)
    moved = tmp_path / "moved"
    got = finish(start(d, ckpt, moved, "--steps", "6"), moved)
    assert [r["start"] for r in got] == [4, 4] and [r["saved"] for r in got] == [[6]] * 2
    assert [c.step for c in d.client(JOB).list()] == [6]
