"""The trainer process of ``bench_every_step.py``: a fixed compute step, every tensor
changed in place, a save at every step.

Run as a script with its configuration as JSON::

    python bench/every_step_trainer.py '{"socket": ..., "job": ..., "tensors": 4,
        "mib": 256, "steps": 40, "work_reps": 12, "save": true}'

Prints one JSON line per step, flushed, once the step's save was acknowledged
(``save()`` returned): ``{"step": k, "step_s": ..., "save_s": ...}``. The state's
``step`` entry holds ``k``, so whoever restores it knows which step it got. A
driver that SIGKILLs this process knows every step printed was acknowledged.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

from ckptd.client import Client
from ckptd.client.policies import Continuous


def compute(reps: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A fixed amount of CPU work (the step's forward and backward pass)."""
    for _ in range(reps):
        a = a @ b
        a /= np.abs(a).max() or 1.0
    return a


def main(cfg: dict[str, Any]) -> None:
    """Train ``cfg["steps"]`` steps, saving each one if ``cfg["save"]``."""
    rng = np.random.default_rng(0)
    each = cfg["mib"] * 2**20 // cfg["tensors"] // 4
    state: dict[str, Any] = {
        f"layer{i}": rng.random(each, dtype=np.float32) for i in range(cfg["tensors"])
    }
    state["step"] = np.zeros(1, np.int64)
    a = rng.random((384, 384), dtype=np.float32)
    b = rng.random((384, 384), dtype=np.float32)
    client = Client(cfg["job"], socket=cfg["socket"], policy=Continuous(stage="memory"))
    if cfg["save"]:
        client.reserve(state)
    for k in range(1, cfg["steps"] + 1):
        t0 = time.perf_counter()
        client.should_save(k)  # the step's clock, as a loop with a policy calls it
        a = compute(cfg["work_reps"], a, b)
        for name, t in state.items():
            if name != "step":
                t += 1.0  # every tensor changed, as a training step changes them
        state["step"][0] = k
        t1 = time.perf_counter()
        if cfg["save"]:
            client.save(k, state)
        t2 = time.perf_counter()
        print(json.dumps({"step": k, "step_s": t2 - t0, "save_s": t2 - t1}), flush=True)
    client.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
