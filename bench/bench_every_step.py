"""Every-step saves on a disk slower than the saves: the trainer's overhead, and the
steps lost per failure kind.

A trainer process (bench/every_step_trainer.py) runs a fixed CPU step, changes every
tensor of its state (``--mib`` in ``--tensors`` arrays) and saves at every step
(``Continuous(stage="memory")``). The daemon's process is put in a blkio cgroup that
throttles its writes to the root's disk to ``--disk-mbps``, so a save takes many
steps to reach the disk. The staging budget is 4 saves (``--budget-saves``): the one
being written, the newest acknowledged, the one being copied and the memory tier's.

Arms, each with a fresh daemon and root, one after another:

- ``no saves``: the floor, the same trainer without a save;
- ``every step``: the defaults: the disk writes the newest save it can, the ones in
  between end SUPERSEDED;
- ``every step, all written``: ``--no-supersede-unwritten``: every acknowledged save
  is written, in order, and the trainer waits for staging memory once the budget is
  full (what ckptd did before).

Then, on the defaults, ``--trials`` runs per failure kind, each SIGKILLing at a
random step (``--seed``) after the first ``--warm`` steps:

- trainer SIGKILL: a new client restores the newest step at once;
- daemon SIGKILL (and the trainer with it): a new daemon on the same root replays
  the acknowledged saves from shared memory; then the restore;
- node restart: both killed and the daemon's shared memory removed (a reboot keeps
  the disk only); a new daemon, then the restore.

Steps lost: the step in progress when killed (the last acknowledged step + 1) minus
the step restored; 1 is the least possible (the step in progress). A table on stdout
and ``bench/results/NAME.json``. Needs root and a cgroup-v1 blkio hierarchy (or it
runs unthrottled and says so).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import DEFAULT_WORK_DIR, Daemon, print_table, run_directory, write_results
from every_step_trainer import compute

from ckptd.client import Client
from ckptd.daemon.local.segments import recorded_dir
from ckptd.proto import ckptd_pb2 as pb

TRAINER = Path(__file__).resolve().parent / "every_step_trainer.py"
BLKIO = Path("/sys/fs/cgroup/blkio")
ARMS = {"no saves": None, "every step": [], "every step, all written": ["--no-supersede-unwritten"]}


class Throttle:
    """A blkio cgroup whose writes to one disk are limited to ``bps`` bytes/s."""

    def __init__(self, path: Path, bps: int) -> None:
        self.dir = BLKIO / f"ckptd-bench-{os.getpid()}"
        dev = os.stat(path).st_dev
        self.device = f"{os.major(dev)}:{os.minor(dev)}"
        self.on = False
        try:
            self.dir.mkdir(exist_ok=True)
            (self.dir / "blkio.throttle.write_bps_device").write_text(f"{self.device} {bps}")
            self.on = True
        except OSError as exc:
            print(f"# no write throttle ({exc}): the disk runs at full speed", file=sys.stderr)

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the cgroup."""
        if self.on:
            (self.dir / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        """Remove the cgroup (its processes are gone by then)."""
        with contextlib.suppress(OSError):
            self.dir.rmdir()


def start_daemon(
    root: Path, args: list[str], budget: int, throttle: Throttle, d: Daemon | None = None
) -> Daemon:
    """A daemon on ``root`` (``d``: that one again), throttled from its first write."""
    d = d or Daemon(root, root.parent / f"{root.name}.sock", staging_budget=str(budget),
                    extra_args=args)  # fmt: skip
    d.start(wait=False)
    assert d.proc is not None
    throttle.add(d.proc.pid)
    d.wait_ready()
    return d


def trainer(cfg: dict[str, Any]) -> subprocess.Popen[str]:
    """Start a trainer process; its stdout carries one JSON line per step."""
    return subprocess.Popen(
        [sys.executable, str(TRAINER), json.dumps(cfg)], stdout=subprocess.PIPE, text=True
    )


def calibrate(step_ms: float) -> int:
    """Matrix products per step for about ``step_ms`` of work on this host, idle."""
    rng = np.random.default_rng(0)
    a, b = rng.random((384, 384), np.float32), rng.random((384, 384), np.float32)
    compute(3, a, b)
    t0 = time.perf_counter()
    compute(20, a, b)
    return max(1, round(step_ms / ((time.perf_counter() - t0) * 1000 / 20)))


def steady_arm(name: str, daemon: Daemon | None, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run the trainer to the end; its step times past the warm-up and what the daemon
    made of its saves."""
    proc = trainer(cfg)
    assert proc.stdout is not None
    lines = [json.loads(line) for line in proc.stdout]
    proc.wait()
    steady = lines[cfg["warm"] :]
    out: dict[str, Any] = {
        "arm": name,
        "steps": len(lines),
        "step_s_median": statistics.median(x["step_s"] for x in steady),
        "step_s_mean": statistics.fmean(x["step_s"] for x in steady),
        "save_s_median": statistics.median(x["save_s"] for x in steady),
        "save_s_max": max(x["save_s"] for x in steady),
    }
    if daemon is not None:
        events = daemon.events(cfg["job"])
        out["local"] = sum(e.kind == pb.STEP_EVENT_LOCAL for e in events)
        out["superseded"] = sum(e.kind == pb.STEP_EVENT_SUPERSEDED for e in events)
    return out


def killed_at(daemon: Daemon, cfg: dict[str, Any], at: int, kind: str) -> tuple[int, Daemon]:
    """Run a trainer until it printed step ``at``, then SIGKILL what ``kind`` says;
    returns the last acknowledged step and the daemon to restore from."""
    proc = trainer(cfg)
    assert proc.stdout is not None
    acked = 0
    for line in proc.stdout:
        acked = json.loads(line)["step"]
        if acked >= at:
            break
    if kind != "trainer":
        daemon.kill()
    proc.kill()
    proc.wait()
    if kind == "node restart":  # a reboot keeps the disk, not the shared memory
        shm = recorded_dir(daemon.root)
        assert shm is not None and shm.is_dir(), "the daemon's segment directory"
        shutil.rmtree(shm)
    return acked, daemon


def failure_trial(
    root: Path, cfg: dict[str, Any], budget: int, throttle: Throttle, kind: str, at: int
) -> dict[str, Any]:
    """One SIGKILL of ``kind`` at step ``at``; the steps lost and the restore's time."""
    daemon = start_daemon(root, [], budget, throttle)
    try:
        acked, daemon = killed_at(daemon, cfg, at, kind)
        if kind != "trainer":  # the same root and socket, a new process
            daemon = start_daemon(root, [], budget, throttle, daemon)
        t0 = time.perf_counter()
        with Client(cfg["job"], socket=cfg["socket"]) as c:
            tree, _ = c.restore()
        restore_s = time.perf_counter() - t0
        got = int(tree["step"][0])
        return {"kind": kind, "killed_after": acked, "restored": got,
                "steps_lost": acked + 1 - got, "restore_s": restore_s}  # fmt: skip
    finally:
        daemon.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="the trainer's state, MiB")
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--step-ms", type=float, default=150.0, help="compute per step, idle")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warm", type=int, default=5, help="steps left out of the medians")
    ap.add_argument("--disk-mbps", type=float, default=100.0, help="the daemon's write limit")
    ap.add_argument("--budget-saves", type=int, default=4)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR)
    ap.add_argument("--name", default="every_step")
    args = ap.parse_args()
    reps = calibrate(args.step_ms)
    rng = random.Random(args.seed)
    budget = args.budget_saves * (args.mib * 17 // 16 + 2) * 2**20  # a segment's headroom
    with run_directory(args.dir, "every-step") as run:
        throttle = Throttle(run, int(args.disk_mbps * 1e6))
        try:
            rows, failures = [], []
            for i, (name, extra) in enumerate(ARMS.items()):
                root = run / f"arm{i}"
                cfg = {"socket": str(root.parent / f"{root.name}.sock"), "job": "bench", "tensors":
                       args.tensors, "mib": args.mib, "steps": args.steps, "work_reps": reps,
                       "save": extra is not None, "warm": args.warm}  # fmt: skip
                daemon = start_daemon(root, extra or [], budget, throttle)
                try:
                    rows.append(steady_arm(name, daemon if extra is not None else None, cfg))
                finally:
                    daemon.stop()
            for kind in ("trainer", "daemon", "node restart"):
                for t in range(args.trials):
                    root = run / f"{kind.replace(' ', '-')}{t}"
                    cfg = {"socket": str(root.parent / f"{root.name}.sock"), "job": "bench",
                           "tensors": args.tensors, "mib": args.mib, "steps": 10**6,
                           "work_reps": reps, "save": True}  # fmt: skip
                    at = rng.randint(args.warm + 5, args.warm + 25)
                    failures.append(failure_trial(root, cfg, budget, throttle, kind, at))
        finally:
            throttle.close()
    floor = rows[0]["step_s_median"]
    print_table(
        [
            "arm",
            "step (median)",
            "/ no saves",
            "save() median",
            "save() max",
            "LOCAL",
            "superseded",
        ],
        [
            [
                r["arm"],
                f"{r['step_s_median'] * 1e3:.0f} ms",
                f"{r['step_s_median'] / floor:.2f}x",
                f"{r['save_s_median'] * 1e3:.0f} ms",
                f"{r['save_s_max'] * 1e3:.0f} ms",
                r.get("local", ""),
                r.get("superseded", ""),
            ]
            for r in rows
        ],
        title=f"every-step saves, {args.mib} MiB state, disk {args.disk_mbps:.0f} MB/s",
    )
    print_table(
        ["failure", "killed after step", "restored", "steps lost", "restore"],
        [
            [
                f["kind"],
                f["killed_after"],
                f["restored"],
                f["steps_lost"],
                f"{f['restore_s']:.2f} s",
            ]
            for f in failures
        ],
        title="steps lost per failure (1: the step in progress)",
    )
    results = {
        "config": vars(args)
        | {
            "dir": str(args.dir),
            "work_reps": reps,
            "throttled": throttle.on,
            "device": throttle.device,
        },
        "arms": rows,
        "failures": failures,
    }
    print(write_results(args.name, results, args.dir))


if __name__ == "__main__":
    main()
