"""``ckptd demo``: a real daemon, a small training loop, a SIGKILL, and a resume.

The trainer (``python -m ckptd.client.demo``, a separate process that uses the
client library) fits a linear model, saving its full state every few steps. The
demo kills it right after an acknowledged save, starts it again, and checks that
the resumed run ends with exactly the parameters of an uninterrupted one (also
computed by running the trainer, without a daemon).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import state_name

from .launcher import DaemonProcess

JOB = "demo-run"
TRAINER = "ckptd.client.demo"


def _trainer(socket: str, steps: int, save_every: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            TRAINER,
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

    daemon = DaemonProcess(
        tmp / "root",
        tmp / "ckptd.sock",
        node_id="demo-node",
        staging_budget="64MiB",
        log_path=tmp / "daemon.log",
    )
    try:
        say(f"workspace {tmp}")
        daemon.start()
        assert daemon.proc is not None
        socket = str(daemon.socket)
        say(f"daemon up (pid {daemon.proc.pid}) on {socket}, local tier {tmp / 'root'}")
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
        wait = pb.GetSaveStatusRequest(
            job=JOB, step=int(last_saved or 0), wait_for=pb.SAVE_STATE_LOCAL, timeout_seconds=60
        )
        daemon.connection.get_save_status(wait, 90.0)
        rows = daemon.connection.list_checkpoints(pb.ListCheckpointsRequest(job=JOB))
        say(
            "daemon holds: "
            + ", ".join(f"step {r.step} {state_name(r.state)}" for r in reversed(rows.checkpoints))
        )
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
        daemon.close()
        if keep:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _quiet_reference(steps: int, save_every: int) -> str:
    """The digest of an uninterrupted run (the trainer without a daemon)."""
    cmd = [sys.executable, "-m", TRAINER, "--steps", str(steps), "--save-every", str(save_every)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout
    done = [json.loads(x) for x in out.splitlines() if '"done"' in x]
    return str(done[-1]["digest"])
