"""The trainer of ``ckptd demo``: a small training loop that saves through the client.

Run as ``python -m ckptd.client.demo --socket PATH``: it fits a linear model with
SGD + momentum, saving its full state (parameters, optimizer moments, RNG
state, data position) every few steps, and resumes from the newest checkpoint
when it starts. It prints one JSON event per line for the demo to follow.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from typing import Any

import numpy as np

JOB = "demo-run"
FEATURES = 256


def _batch(rng: np.random.Generator, true_w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((64, FEATURES)).astype(np.float32)
    y = x @ true_w + 0.01 * rng.standard_normal(64).astype(np.float32)
    return x, y


def train(steps: int, save_every: int, socket: str | None, step_seconds: float = 0.0) -> str:
    """Train to ``steps``, resuming from ckptd if it has a checkpoint; returns a params digest."""
    true_w = np.random.default_rng(1234).standard_normal(FEATURES).astype(np.float32)
    state: dict[str, Any] = {
        "params": {"w": np.zeros(FEATURES, np.float32), "b": np.float32(0.0)},
        "opt": {"mw": np.zeros(FEATURES, np.float32), "mb": np.float32(0.0)},
        "rng": np.random.default_rng(0).bit_generator.state,
        "data": {"batches_seen": 0},
    }
    start = 0
    client = None
    if socket is not None:
        from . import CheckpointNotFound, Client

        client = Client(JOB, socket=socket)
        try:
            state, meta = client.restore()
            start = int(meta["step"]) + 1
            _emit("resumed", step=meta["step"], loss=meta["loss"])
        except CheckpointNotFound:
            _emit("fresh")
    rng = np.random.default_rng()
    rng.bit_generator.state = state["rng"]
    p, o = state["params"], state["opt"]
    w, b, mw, mb = p["w"], np.float32(p["b"]), o["mw"], np.float32(o["mb"])
    loss = float("nan")
    for step in range(start, steps):
        x, y = _batch(rng, true_w)
        err = x @ w + b - y
        loss = float(np.mean(err**2))
        mw = np.float32(0.9) * mw + (x.T @ err) / np.float32(len(y))
        mb = np.float32(0.9) * mb + np.float32(err.mean())
        w = w - np.float32(0.01) * mw
        b = np.float32(b - np.float32(0.01) * mb)
        time.sleep(step_seconds)
        if client is not None and (step + 1) % save_every == 0:
            tree = {
                "params": {"w": w, "b": b},
                "opt": {"mw": mw, "mb": mb},
                "rng": rng.bit_generator.state,
                "data": {"batches_seen": step + 1},
            }
            client.save(step, tree, metadata={"step": step, "loss": loss})
            _emit("saved", step=step, loss=loss)
    digest = hashlib.sha256(w.tobytes() + np.float32(b).tobytes()).hexdigest()[:16]
    _emit("done", step=steps - 1, loss=loss, digest=digest)
    return digest


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main() -> None:
    """Entry point of the demo's trainer processes."""
    ap = argparse.ArgumentParser(prog="python -m ckptd.client.demo")
    ap.add_argument("--socket", help="the daemon's socket; without it, train with no saves")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--step-seconds", type=float, default=0.0)
    a = ap.parse_args()
    train(a.steps, a.save_every, a.socket, a.step_seconds)


if __name__ == "__main__":
    main()
