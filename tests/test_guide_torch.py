"""The PyTorch guide's example (docs/guides/pytorch.md), exactly as printed: SIGKILLed right after a
``dcp.async_save`` returned, resumed in a new process with ``dcp.load`` through ckptd,
and bit-identical to a run never stopped (every loss after the resume, and the final
parameters and optimizer state)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch tests need torch (make venv installs a CPU build)")

from ckptd.client import SaveFailed, SaveHandle

from .conftest import Daemon

REPO = Path(__file__).resolve().parent.parent
KILL_AT = 12
AFTER = 20
"""The runs end this many steps after the save the first process was killed at."""

PRELUDE = """
import hashlib, json, os, signal, sys, warnings
import torch
import torch.distributed.checkpoint

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
torch.set_num_threads(1)
num_steps = int(os.environ["NUM_STEPS"])
kill_at = int(os.environ.get("KILL_AT", "0"))
losses = {}

def next_batch(offset):
    g = torch.Generator().manual_seed(offset)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :1] * 2.0

_mse = torch.nn.functional.mse_loss
def _recording_mse(*args, **kw):  # the loss of each step, for the comparison
    out = _mse(*args, **kw)
    losses[len(losses)] = out.item()
    return out
torch.nn.functional.mse_loss = _recording_mse

_async_save = torch.distributed.checkpoint.async_save
def _async_save_then_maybe_die(*args, **kw):
    future = _async_save(*args, **kw)
    step = kw["checkpoint_id"]
    if kill_at and step >= kill_at:  # killed right after async_save returned
        print(json.dumps({"returned": step}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return future
torch.distributed.checkpoint.async_save = _async_save_then_maybe_die
"""
EPILOGUE = """
digest = hashlib.sha256()
for t in [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values())]:
    digest.update(t.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
print(json.dumps({
    "start": start,
    "step": state.step,
    "offset": state.data_offset,
    "losses": {start + 1 + i: v for i, v in losses.items()},
    "digest": digest.hexdigest(),
}))
"""


def guide_example() -> str:
    """The code block after the ``torch-example`` marker in the PyTorch guide."""
    text = (REPO / "docs/guides/pytorch.md").read_text()
    return text.split("<!-- torch-example -->\n```python\n", 1)[1].split("```", 1)[0]


def test_guide_torch_example_killed_after_async_save_resumes_bit_identical(
    make_daemon: Any, tmp_path: Path
) -> None:
    script = tmp_path / "example.py"
    script.write_text(PRELUDE + guide_example() + EPILOGUE)

    def run(d: Daemon, steps: int, kill_at: int = 0) -> tuple[int, list[dict[str, Any]]]:
        env = {
            **os.environ,
            "CKPTD_SOCKET": str(d.socket),
            "NUM_STEPS": str(steps),
            "KILL_AT": str(kill_at),
        }
        proc = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
        )
        lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode not in (0, -signal.SIGKILL):
            pytest.fail(f"the example failed ({proc.returncode}):\n{proc.stderr[-5000:]}")
        return proc.returncode, lines

    d: Daemon = make_daemon()
    # should_save decides which steps save: killed at the first save from KILL_AT on.
    rc, out = run(d, 10_000, KILL_AT)
    assert rc == -signal.SIGKILL and len(out) == 1, out
    killed = out[0]["returned"]
    assert killed >= KILL_AT
    steps = killed + AFTER
    client = d.client("mlp-torch")
    for c in client.list():  # a handoff acknowledged before the kill is finished now
        with contextlib.suppress(SaveFailed):
            SaveHandle(client, c.step).wait("local", 60)
    saved = sorted(c.step for c in client.list() if c.state == "LOCAL")
    rc, out = run(d, steps)  # a new process: dcp.load of the newest step ckptd holds
    assert rc == 0
    resumed = out[-1]
    rc, out = run(d, steps)  # run again as printed: it resumes from its last step
    assert rc == 0 and (out[-1]["start"], out[-1]["digest"]) == (steps, resumed["digest"])

    fresh = make_daemon()
    jax_example = _jax_example_beside(fresh, tmp_path)
    rc, out = run(fresh, steps)  # never stopped (the JAX guide's example ran there first)
    assert rc == 0
    straight = out[-1]
    assert jax_example.returncode == 0, jax_example.stderr[-3000:]
    assert (straight["start"], straight["step"], straight["offset"]) == (0, steps, steps)
    # The step whose async_save had returned is the one restored if its handoff
    # finished before the kill, else an earlier one; either resumes exactly.
    assert 0 < resumed["start"] <= killed and resumed["start"] == max(saved), (resumed, saved)
    assert (resumed["step"], resumed["offset"]) == (steps, steps)
    assert len(resumed["losses"]) >= AFTER
    assert resumed["losses"] == {k: straight["losses"][k] for k in resumed["losses"]}
    assert resumed["digest"] == straight["digest"]


def _jax_example_beside(d: Daemon, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The JAX guide's example run on the same daemon first: each example has its own
    job, so running one after the other works as printed."""
    from . import test_guide_jax

    script = tmp_path / "jax_example.py"
    script.write_text(test_guide_jax.PRELUDE + test_guide_jax.guide_example())
    env = {**os.environ, "CKPTD_SOCKET": str(d.socket), "NUM_STEPS": "3"}
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
    )
