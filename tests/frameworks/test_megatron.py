"""Megatron-Core's ``dist_checkpointing`` through ckptd (ckptd.client.megatron):
Megatron-Core's own ``save``/``load`` and fully parallel save wrapper, 2 processes
over gloo on CPU (tests/frameworks/megatron_worker.py), against a real daemon with
a ``file://`` bucket.

- A synchronous save: the tensors are a ckptd step (nothing but ``common.pt`` and
  ``metadata.json`` in the directory), loaded back equal on both ranks.
- An async save SIGKILLed right after Megatron's ``save`` returned the request
  (before its finalize, so before ``metadata.json``): the step is in ckptd, and
  ``ensure_local`` + ``load`` restore it exactly.
- A lost node: daemon root and checkpoint directory gone, a fresh daemon on the
  bucket: ``ensure_local`` writes ``common.pt`` and ``metadata.json`` back and the
  load reads the tensors from the bucket.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from ckptd.client import SaveHandle
from ckptd.proto import ckptd_pb2 as pb

from ..conftest import Daemon, RemoteTarget
from ..test_remote_tier import remote_daemon

WORKER = Path(__file__).with_name("megatron_worker.py")
REPO = Path(__file__).resolve().parents[2]
JOB = "mcore"


def run(d: Daemon, mode: str, ckpt: Path, out: Path, *extra: str, rc: int = 0) -> list[Any]:
    """The worker as 2 processes (gloo); each one's JSON line."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), mode, str(d.socket), JOB, str(ckpt), str(out), *extra],
            cwd=REPO,
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    for p in procs:
        log, _ = p.communicate(timeout=300)
        assert p.returncode == rc, log[-6000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]


def test_save_load_async_kill_and_lost_node(make_daemon: Any, tmp_path: Path) -> None:
    bucket = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    d: Daemon = remote_daemon(make_daemon, bucket)
    five = tmp_path / "ckpt" / "iter_0000005"
    saved = run(d, "save", five, tmp_path / "save")
    assert [s["files"] for s in saved] == [["common.pt", "metadata.json"]] * 2
    assert json.loads((five / "metadata.json").read_text())["sharded_backend"] == "ckptd"
    assert [c.step for c in d.client(JOB).list()] == [5]
    loaded = run(d, "load", five, tmp_path / "load5")
    assert [(r["equal"], r["wrote"], r["iteration"]) for r in loaded] == [(True, False, 5)] * 2
    assert [r["rng"] for r in loaded] == [{"rank": 0, "step": 5}, {"rank": 1, "step": 5}]

    # Async, killed right after save() handed the tensors over: Megatron never wrote
    # metadata.json, but the daemon has the step; ensure_local completes the directory.
    ten = tmp_path / "ckpt" / "iter_0000010"
    run(d, "async", ten, tmp_path / "async", "kill", rc=-9)
    assert not (ten / "metadata.json").exists()
    SaveHandle(d.client(JOB), 10).wait("durable", timeout=120)
    after_kill = run(d, "load", ten, tmp_path / "load10")
    assert [(r["equal"], r["iteration"]) for r in after_kill] == [(True, 10)] * 2
    assert after_kill[0]["wrote"] or after_kill[1]["wrote"]

    # A lost node: its disk (the daemon's root and the checkpoint directory) is gone.
    d.kill()
    shutil.rmtree(d.root)
    shutil.rmtree(tmp_path / "ckpt")
    fresh: Daemon = remote_daemon(make_daemon, bucket)
    lost = run(fresh, "load", ten, tmp_path / "lost")
    assert [(r["equal"], r["iteration"]) for r in lost] == [(True, 10)] * 2
    assert sorted(os.listdir(ten)) == ["common.pt", "metadata.json"]
    assert [e.step for e in fresh.events_of(pb.STEP_EVENT_FETCHED, JOB)] == [10]
