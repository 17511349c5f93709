"""``ckptd demo``: a real daemon, a small training loop, a SIGKILL, and a resume.

The trainer (run as ``python -m ckptd.daemon.demo trainer ...``) fits a linear
model with SGD + momentum, saving its full state (parameters, optimizer moments,
RNG state, data position) every few steps. The demo kills it right after an
acknowledged save, starts it again, and checks that the resumed run ends with
exactly the parameters of an uninterrupted one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
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
        from ckptd.client import CheckpointNotFound, Client

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


def _start_daemon(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    socket = str(tmp / "ckptd.sock")
    log = open(tmp / "daemon.log", "wb")  # noqa: SIM115 - lives as long as the daemon
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ckptd.daemon.cli",
            "serve",
            "--root",
            str(tmp / "root"),
            "--socket",
            socket,
            "--node-id",
            "demo-node",
            "--staging-budget-bytes",
            "64MiB",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    from ckptd.client import CkptdUnavailable, Client

    probe = Client(JOB, socket=socket)
    deadline = time.monotonic() + 30
    while True:
        try:
            probe.list()
            break
        except CkptdUnavailable:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not start; see {tmp / 'daemon.log'}") from None
            time.sleep(0.1)
    probe.close()
    return proc, socket


def _trainer(socket: str, steps: int, save_every: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ckptd.daemon.demo",
            "trainer",
            "--socket",
            socket,
            "--steps",
            str(steps),
            "--save-every",
            str(save_every),
            "--step-seconds",
            "0.02",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def run_demo(steps: int = 40, save_every: int = 5, keep: bool = False) -> int:
    """The README's first command. Returns 0 if the resumed run matches the reference."""
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-demo-"))

    def say(msg: str) -> None:
        print(f"[demo] {msg}", flush=True)

    daemon = None
    try:
        say(f"workspace {tmp}")
        daemon, socket = _start_daemon(tmp)
        say(f"daemon up (pid {daemon.pid}) on {socket}, local tier {tmp / 'root'}")
        kill_after = 3 * save_every - 1
        say(
            f"trainer #1: {steps} steps, saving every {save_every}; it is SIGKILLed right after "
            f"the save of step {kill_after} is acknowledged"
        )
        t1 = _trainer(socket, steps, save_every)
        assert t1.stdout is not None
        last_saved = None
        for line in t1.stdout:
            ev = json.loads(line)
            if ev["event"] == "saved":
                last_saved = ev["step"]
                say(f"  step {ev['step']:3d}  loss {ev['loss']:.4f}  save() returned")
                if ev["step"] >= kill_after:
                    os.kill(t1.pid, signal.SIGKILL)
                    break
        t1.wait()
        say(
            f"trainer #1 SIGKILLed (exit {t1.returncode}); "
            f"its last acknowledged save was step {last_saved}"
        )
        from ckptd.client import Client
        from ckptd.client.handle import SaveHandle

        with Client(JOB, socket=socket) as c:
            SaveHandle(c, int(last_saved or 0)).wait("local", timeout=60)
            rows = c.list()
        say("daemon holds: " + ", ".join(f"step {r.step} {r.state}" for r in reversed(rows)))
        say("trainer #2: restarts and resumes from the newest checkpoint")
        t2 = _trainer(socket, steps, save_every)
        out, _ = t2.communicate(timeout=300)
        events = [json.loads(x) for x in out.splitlines()]
        resumed = next(e for e in events if e["event"] in ("resumed", "fresh"))
        done = next(e for e in events if e["event"] == "done")
        say(
            f"  resumed from step {resumed.get('step')} "
            f"(loss {resumed.get('loss', float('nan')):.4f}), "
            f"trained to step {done['step']}, final loss {done['loss']:.4f}"
        )
        reference = _quiet_reference(steps, save_every)
        same = reference == done["digest"]
        say(
            f"final parameters {done['digest']} vs uninterrupted run {reference}: "
            + ("IDENTICAL" if same else "DIFFERENT")
        )
        ok = same and resumed.get("step") == last_saved
        say(
            "result: "
            + (
                "the kill cost only the steps after the last save; training resumed exactly"
                if ok
                else "FAILED: the resumed run did not match"
            )
        )
        return 0 if ok else 1
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=60)
        if keep:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _quiet_reference(steps: int, save_every: int) -> str:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return train(steps, save_every, socket=None)


def main() -> None:
    """Trainer entry point for the demo's child processes."""
    ap = argparse.ArgumentParser(prog="python -m ckptd.daemon.demo")
    ap.add_argument("role", choices=["trainer"])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--step-seconds", type=float, default=0.0)
    a = ap.parse_args()
    train(a.steps, a.save_every, a.socket, a.step_seconds)


if __name__ == "__main__":
    main()
