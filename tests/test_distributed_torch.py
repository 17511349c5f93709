"""Restore agreement over torch.distributed: two gloo processes, each with its own
daemon holding different steps, agree on the newest step both can restore (and
jax is never asked: a torch job has no jax runtime)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agree(sockets: list[Path], tmp_path: Path) -> list[str]:
    port = _free_port()
    outs = [tmp_path / f"agreed-{i}" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.torch_agree_worker", str(i), str(port), str(s), str(o)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, (s, o) in enumerate(zip(sockets, outs, strict=True))
    ]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    for p in procs:
        assert p.returncode == 0, "\n".join(log[-3000:] for log in logs)
    return [o.read_text() for o in outs]


def test_torch_processes_agree_on_the_newest_step_every_node_can_restore(
    make_daemon: Any, tmp_path: Path
) -> None:
    daemons = [make_daemon(), make_daemon()]
    assert _agree([d.socket for d in daemons], tmp_path) == ["none", "none"]
    # Node 0 holds steps 1..3 of its rank, node 1 only 1..2: both must pick 2.
    for rank, (d, steps) in enumerate(zip(daemons, ([1, 2, 3], [1, 2]), strict=True)):
        c = d.client("agree", rank=rank, node_ranks=[rank], world_size=2)
        for step in steps:
            c.save(step, {"w": np.full(4, step, np.float32)}).wait("local", timeout=60)
    assert _agree([d.socket for d in daemons], tmp_path) == ["2", "2"]
