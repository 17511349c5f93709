"""MaxText's own checkpointing through ckptd: ``use_in_maxtext()`` and nothing else
changed, against a real daemon (tests/frameworks/maxtext_worker.py, run in the
Python 3.12 venv `make test-maxtext` builds: MaxText 0.2.5, whose checkpointer is
Orbax's v1 ``ocp.training.Checkpointer``, or with ``MAXTEXT_VERSION=0.2.4`` the v0
``ocp.CheckpointManager``; jax 0.12, CPU).

- MaxText's checkpointing functions on a sharded flax ``TrainState``:
  ``create_orbax_checkpoint_manager`` returns ckptd's checkpointer, ``save_checkpoint``
  honours the checkpoint period, ``load_state_if_possible`` in a new manager
  restores it, equal leaf for leaf and sharding for sharding.
- MaxText's pre-training loop on a tiny decoder, SIGKILLed right after a save
  returned, restarted with another ``init_weights_seed``: it resumes from ckptd
  (a run from scratch would end elsewhere) and ends bit-identical to a run never
  interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client import SaveHandle

from ..conftest import Daemon

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-maxtext" / "bin" / "python"
WORKER = Path(__file__).with_name("maxtext_worker.py")

pytestmark = pytest.mark.skipif(
    not PYTHON.exists(),
    reason="MaxText needs Python 3.12 and its own venv: `make test-maxtext` builds "
    ".venv-maxtext and runs these",
)
jax = pytest.importorskip("jax")

STEPS, PERIOD, KILL_AT = 8, 3, 3
"""MaxText saves steps 0, 3, 6 and, at the end, 7 (its last step)."""


def worker(daemon: Daemon, tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.Popen(
        [str(PYTHON), str(WORKER), args[0], str(daemon.socket), *args[1:]],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 600) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    assert proc.returncode == 0, out[-6000:]
    return out


def test_maxtext_checkpointing_functions(daemon: Daemon, tmp_path: Path) -> None:
    out = finish(worker(daemon, tmp_path, "functions", "fn", str(tmp_path / "out")))
    assert json.loads(out.strip().splitlines()[-1]) == {"steps": [5], "restored_step": 5}
    (info,) = daemon.client("fn").list()
    assert info.step == 5 and info.state in ("LOCAL", "DRAINING", "DURABLE")


def raw(x: Any) -> bytes:
    """A leaf's bytes (typed PRNG keys: their key data)."""
    if isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).tobytes()


def test_maxtext_train_loop_killed_after_a_save_resumes_bit_exact(
    daemon: Daemon, tmp_path: Path
) -> None:
    outdir = str(tmp_path / "out")
    train = ["train", "RUN", outdir, str(STEPS), str(PERIOD)]
    ref = worker(daemon, tmp_path, *[a.replace("RUN", "ref") for a in train], "0")
    run = worker(daemon, tmp_path, *[a.replace("RUN", "run") for a in train], "0", str(KILL_AT))
    held = Path(outdir) / "held"
    t0 = time.monotonic()
    while not held.exists():
        assert run.poll() is None, run.communicate()[0][-6000:]
        assert time.monotonic() - t0 < 600, "MaxText never saved the step to hold at"
        time.sleep(0.1)
    run.send_signal(signal.SIGKILL)  # right after MaxText's save returned
    run.wait(60)
    assert held.read_text() == str(KILL_AT)
    SaveHandle(daemon.client("run"), KILL_AT).wait("local", 120)
    finish(ref)
    resumed = [a.replace("RUN", "run") for a in train]
    finish(worker(daemon, tmp_path, *resumed, "1"))  # another init seed: only a restore
    want, _ = daemon.client("ref").restore(step=STEPS - 1)  # ends where ref ended
    got, _ = daemon.client("run").restore(step=STEPS - 1)
    w_leaves = jax.tree_util.tree_leaves_with_path(want["items"])
    g_leaves = jax.tree_util.tree_leaves_with_path(got["items"])
    assert [p for p, _ in g_leaves] == [p for p, _ in w_leaves]
    assert len(w_leaves) > 50  # params, Adam's mu and nu, the step, nnx rng state
    differ = [
        jax.tree_util.keystr(p)
        for (p, w), (_, g) in zip(w_leaves, g_leaves, strict=True)
        if raw(w) != raw(g)
    ]
    assert not differ, differ
    assert daemon.client("run").all_steps()[-1] == STEPS - 1
