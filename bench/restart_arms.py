"""Helpers of ``bench_restart.py``: the state images, the arms' processes, DLRover's agent.

- :func:`write_image`: a state written once as one raw file plus a JSON layout, which
  every trainer process reads (``restart_trainer.py``);
- :func:`tier_args`: the daemon flag that turns ckptd's memory tier on or off;
- :class:`DlroverAgent`: DLRover's checkpoint saver in a long-lived process of its own,
  as ``dlrover-run``'s agent runs it beside the trainers on a node;
- :class:`Arm`: one repetition of one arm: a trainer saves, is SIGKILLed, a new
  trainer restores; returns the restarted trainer's timings.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
from common import BENCH_DIR, Daemon, drop_caches, settle
from transformer_arms import Tree

TRAINER = BENCH_DIR / "restart_trainer.py"
ALIGN = 4096


def tier_args(steps: int) -> list[str]:
    """``ckptd serve`` flags for a memory tier of ``steps`` steps per job (0: off)."""
    return ["--memory-tier-steps", str(steps)]


def write_image(state: Tree, path: Path) -> dict[str, Any]:
    """Write ``state``'s leaves into ``path`` (each at a page boundary) and its layout to
    ``path.json``; returns the layout (``arrays``: path, dtype, shape, offset)."""
    arrays: list[dict[str, Any]] = []
    offset = nbytes = 0
    with open(path, "wb") as f:

        def walk(tree: Tree, prefix: list[str]) -> None:
            nonlocal offset, nbytes
            for k, v in tree.items():
                if isinstance(v, dict):
                    walk(v, [*prefix, k])
                    continue
                a = np.ascontiguousarray(v)
                f.seek(offset)
                f.write(a.tobytes())
                entry = {"path": [*prefix, k], "dtype": a.dtype.name, "shape": list(a.shape)}
                arrays.append({**entry, "offset": offset})
                offset += -(-a.nbytes // ALIGN) * ALIGN
                nbytes += a.nbytes

        walk(state, [])
        f.truncate(offset)
    layout = {"arrays": arrays, "nbytes": nbytes}
    Path(f"{path}.json").write_text(json.dumps(layout))
    return layout


def read_json_line(proc: subprocess.Popen[str], timeout: float, log: Path) -> dict[str, Any]:
    """The first line ``proc`` prints, as JSON; raises with the log's tail if it exits
    or stays silent for ``timeout`` seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line.strip():
        proc.kill()
        proc.wait()
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        raise RuntimeError(
            f"trainer {proc.args!r} gave no result (exit {proc.returncode}):\n{tail}"
        )
    return dict(json.loads(line))


class DlroverAgent:
    """DLRover's saver factory and saver in one process (``restart_trainer.py agent``),
    with its shared memory and sockets named after ``run_id``."""

    def __init__(self, python: str, run_id: str, log: IO[str]) -> None:
        self.run_id = run_id
        self.env = dlrover_env(run_id)
        self.proc = subprocess.Popen(
            [python, str(TRAINER), "agent"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=self.env,
        )
        self._expect("ready")

    def _expect(self, word: str) -> None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        got = self.proc.stdout.readline().strip() if ready else ""
        if got != word:
            raise RuntimeError(f"DLRover agent said {got!r}, not {word!r} (see the run log)")

    def reset(self) -> None:
        """What the agent does before it restarts a failed trainer (releases the locks)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("reset\n")
        self.proc.stdin.flush()
        self._expect("ok")

    def close(self) -> None:
        """Stop the agent; remove its shared memory and sockets."""
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        for leftover in glob.glob(f"/dev/shm/{self.run_id}_*"):
            with contextlib.suppress(OSError):
                os.unlink(leftover)
        shutil.rmtree(f"/tmp/ckpt_sock/{self.run_id}", ignore_errors=True)


def dlrover_env(run_id: str) -> dict[str, str]:
    """A trainer started by ``dlrover-run`` on one node: local rank 0, its role (so the
    engine uses the agent's saver instead of forking one), the run id naming its
    shared memory and sockets."""
    env = dict(os.environ)
    env |= {"ROLE_NAME": "dlrover-trainer", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": run_id}
    env |= {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    return env


class Arm:
    """One arm on one state: where its trainers save and what they run."""

    def __init__(
        self,
        name: str,
        state: str,
        run: Path,
        python: str,
        *,
        daemon: Daemon | None = None,
        agent: DlroverAgent | None = None,
    ) -> None:
        self.name, self.state, self.run = name, state, run
        self.python, self.daemon, self.agent = python, daemon, agent
        self.log = run / f"trainers-{name}-{state}.log"
        self.dir = run / f"{name}-{state}"

    def config(self, step: int) -> dict[str, Any]:
        """What the trainers of ``step`` are told (``restart_trainer.py``)."""
        cfg: dict[str, Any] = {"arm": self.name, "step": step}
        cfg |= {"image": str(self.run / f"{self.state}.img")}
        cfg["layout"] = f"{cfg['image']}.json"
        if self.daemon is not None:
            cfg |= {"job": f"restart-{self.state}", "socket": str(self.daemon.socket)}
        elif self.name == "dcp":
            cfg["dir"] = str(self.dir / f"step-{step}")
        else:
            cfg["dir"] = str(self.dir)
        return cfg

    def _spawn(self, role: str, cfg: dict[str, Any], log: IO[str]) -> subprocess.Popen[str]:
        env = self.agent.env if self.agent is not None else None
        cmd = [self.python, str(TRAINER), role, json.dumps(cfg)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)

    def rep(self, step: int) -> dict[str, float]:
        """Save ``step`` in a trainer, SIGKILL it, restore in a new one; the timings."""
        cfg = self.config(step)
        with open(self.log, "a") as log:
            saver = self._spawn("save", cfg, log)
            try:
                saved = read_json_line(saver, 600, self.log)
            finally:
                saver.send_signal(signal.SIGKILL)
                saver.wait()
            if self.agent is not None:
                self.agent.reset()
            # Cold: a daemon without the memory tier, and DCP, read the step's files.
            files = self.daemon.root / cfg["job"] if self.daemon is not None else cfg.get("dir")
            if self.name != "dlrover" and not drop_caches(str(files)):
                raise RuntimeError(f"{self.name}: no files under {files} to evict")
            settle()
            t_spawn = time.clock_gettime(time.CLOCK_MONOTONIC)
            restorer = self._spawn("restore", cfg, log)
            try:
                got = read_json_line(restorer, 600, self.log)
            finally:
                restorer.wait()
        if self.name == "dcp":
            shutil.rmtree(cfg["dir"], ignore_errors=True)
        return {
            "restore": got["restore_s"],
            "touched": got["touched_s"],
            "restart": got["t_touched"] - t_spawn,
            "restart_restored": got["t_restored"] - t_spawn,
            "imports": got["t_imported"] - t_spawn,
            "setup": got["t_call"] - got["t_imported"],
            "saved": saved["saved_s"],
        }


def python_ok(python: str, module: str) -> str | None:
    """None if ``python`` can import ``module`` (and torch), else why not."""
    if not Path(python).exists():
        return f"{python} does not exist"
    code = f"import torch, {module}"
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


def versions(python: str, dists: tuple[str, ...]) -> dict[str, str]:
    """The installed versions of ``dists`` in ``python``'s environment (for the results)."""
    code = "import importlib.metadata as m, sys; print(*[m.version(d) for d in sys.argv[1:]])"
    r = subprocess.run([python, "-c", code, *dists], capture_output=True, text=True, check=False)
    return dict(zip(dists, r.stdout.split(), strict=False))


def this_python() -> str:
    """The interpreter running the benchmark (the project's venv)."""
    return sys.executable
