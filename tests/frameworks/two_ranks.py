"""What the two-process framework tests share: the worker started as 2 ranks over
gloo (as torchrun would), waited for, or SIGKILLed once both ranks' save returned;
what each rank wrote; and a bit-exact comparison of nested state."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]


def start(argv: list[str], env: dict[str, str] | None = None) -> list[subprocess.Popen[str]]:
    """``python *argv`` as ranks 0 and 1 of a 2-process gloo job on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
            **(env or {})}  # fmt: skip
    return [
        subprocess.Popen(
            [sys.executable, *argv],
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
    """Wait until both workers' save of the kill step returned, then make sure both
    are gone (each kills itself; a rank blocked in a collective is killed here)."""
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
    """What each rank saved at its end (``OUT.<rank>.pt``)."""
    return [torch.load(f"{out}.{rank}.pt", weights_only=False) for rank in (0, 1)]


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Bit-exact, through nested dicts, lists and tensors."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(map(str, got)) == sorted(map(str, want)), where
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    elif hasattr(want, "__dict__"):  # DeepSpeed's loss scaler: no __eq__
        assert type(got) is type(want), where
        assert_same(vars(got), vars(want), where)
    else:
        assert got == want, where
