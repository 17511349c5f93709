"""The JAX guide's example (docs/guides/jax.md), exactly as printed: trained, stopped, resumed in a
new process from ckptd, and bit-identical to a run never stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

from .conftest import Daemon

REPO = Path(__file__).resolve().parent.parent

PRELUDE = """
import hashlib, json, os
import numpy as np
num_steps = int(os.environ["NUM_STEPS"])

def next_batch(offset):
    rng = np.random.default_rng(offset)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    return x, x[:, :1] * 2.0
"""
EPILOGUE = """
import jax as _jax
leaves = _jax.tree.leaves(ckpt["state"].params) + _jax.tree.leaves(ckpt["state"].opt_state)
digest = hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in leaves))
digest.update(np.asarray(_jax.random.key_data(ckpt["state"].rng)).tobytes())
print(json.dumps({
    "start": start,
    "step": int(ckpt["state"].step),
    "offset": ckpt["data_offset"],
    "types": [type(ckpt["state"]).__name__, str(ckpt["state"].rng.dtype)],
    "digest": digest.hexdigest(),
}))
"""


def guide_example() -> str:
    """The code block after the ``jax-example`` marker in the JAX guide."""
    text = (REPO / "docs/guides/jax.md").read_text()
    return text.split("<!-- jax-example -->\n```python\n", 1)[1].split("```", 1)[0]


def test_guide_jax_example_resumes_bit_identical(make_daemon: Any, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(PRELUDE + guide_example() + EPILOGUE)

    def run(d: Daemon, steps: int) -> dict[str, Any]:
        env = {**os.environ, "CKPTD_SOCKET": str(d.socket), "NUM_STEPS": str(steps)}
        proc = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
        )
        assert proc.returncode == 0, proc.stderr[-5000:]
        result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        return result

    d: Daemon = make_daemon()
    first = run(d, 6)
    assert (first["start"], first["step"], first["offset"]) == (0, 6, 6)
    resumed = run(d, 10)
    assert (resumed["start"], resumed["step"], resumed["offset"]) == (6, 10, 10)
    again = run(d, 10)  # run again as printed: it resumes from its last step, nothing to do
    assert (again["start"], again["digest"]) == (10, resumed["digest"])
    assert resumed["types"] == ["TrainState", "key<fry>"]
    straight = run(make_daemon(), 10)
    assert straight["start"] == 0 and straight["digest"] == resumed["digest"]
