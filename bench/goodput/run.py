"""Goodput under failures: a real training job SIGKILLed at exponential times.

For each MTBF and failure schedule (a seed: the kill times, drawn once from an
exponential distribution and used for every arm), each arm runs the job of
bench/goodput/job.py for ``--seconds`` of wall time under this supervisor, which
kills it at those times and restarts it at once; the new process restores from
its arm's newest checkpoint and trains on. Before the arms, an uninterrupted
``noop`` run (no checkpointing) gives the failure-free step rate and every
step's loss, the reference each arm's losses must equal bit for bit.

    goodput = useful steps / (wall seconds x failure-free steps per second)

where useful steps is the step the job has reached when the time is up. Per
cell: goodput (median and spread over the schedules), work lost per failure
(P50/P90, seconds), restore time (process start to state restored, P50/P90),
checkpoint interval (P50, seconds), step-time overhead against the noop run and
whether every step's loss equals the reference.

Arms: ``ckptd-goodput`` (``Goodput()``, the policy under test), ``ckptd-continuous``
(``Continuous()``, today's default), ``orbax-continuous``
(``ContinuousCheckpointingPolicy``) and ``orbax-yd``: Orbax every k steps, k from
Young/Daly with Orbax's *effective* cost of a save, measured in a calibration run
(every 5 steps; cost = the slowdown of its steps per save).

Results: a table on stdout, bench/results/goodput.json and a plot,
bench/results/goodput.png. ``--quick`` (``make goodput``) is a short version.
"""

from __future__ import annotations

import argparse
import itertools
import math
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import DEFAULT_WORK_DIR, RESULTS_DIR, print_table, write_results  # noqa: E402

from ckptd.daemon.app.launcher import DaemonProcess as Daemon  # noqa: E402

ARMS = ("ckptd-goodput", "ckptd-continuous", "orbax-continuous", "orbax-yd")
Progress = dict[str, Any]


def kill_times(mtbf: float, seconds: float, seed: int) -> list[float]:
    """Failure times in [0, seconds): a Poisson process of rate 1/mtbf."""
    rng = np.random.default_rng(seed)
    times, t = [], 0.0
    while True:
        t += float(rng.exponential(mtbf))
        if t >= seconds:
            return times
        times.append(t)


def step_times(steps: list[Any]) -> list[float]:
    """Seconds between consecutive steps, after a life's first two (compilation)."""
    return [b[1] - a[1] for a, b in itertools.pairwise(steps[2:])]


def parse(path: Path) -> list[list[str]]:
    """The job's event lines (a torn last line, from a kill mid-write, dropped)."""
    text = path.read_text() if path.exists() else ""
    lines = text.split("\n")[:-1]  # the part after the last newline is torn or empty
    return [ln.split() for ln in lines if ln]


class Run:
    """One arm under one failure schedule."""

    def __init__(self, args: argparse.Namespace, arm: str, work: Path, extra: list[str]) -> None:
        self.args, self.arm, self.work = args, arm, work
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        self.progress = work / "progress.log"
        self.daemon: Daemon | None = None
        self.cmd = [
            sys.executable,
            str(HERE / "job.py"),
            "--arm",
            "orbax-interval" if arm == "orbax-yd" else arm,
            "--progress",
            str(self.progress),
            "--state-mib",
            str(args.state_mib),
            "--dir",
            str(work / "orbax"),
            *extra,
        ]
        if arm.startswith("ckptd"):
            self.daemon = Daemon(
                work / "root",
                work / "ckptd.sock",
                extra_args=["--retention-local", "KeepLatest(2)", *args.daemon_args.split()],
                log_path=work / "ckptd.log",
            ).start()
            self.cmd += ["--socket", str(self.daemon.socket)]

    def go(self, kills: list[float], seconds: float) -> list[float]:
        """Run for ``seconds``, SIGKILLing the job at ``kills``; returns the kill times
        (unix)."""
        start = time.time()
        done: list[float] = []
        proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=self._errlog())
        for at in [*kills, seconds]:
            delay = start + at - time.time()
            if delay > 0:
                time.sleep(delay)  # the schedule is wall time: sleeping is the point
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            done.append(time.time())
            if at != seconds:
                proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=self._errlog())
        self.start = start
        return done[:-1]

    def _errlog(self) -> Any:
        return (self.work / "job.err").open("ab")

    def close(self) -> None:
        """Stop the daemon (if any)."""
        if self.daemon is not None:
            self.daemon.stop()


def summarize(
    events: list[list[str]],
    start: float,
    seconds: float,
    rate: float,
    base_step: float,
    reference: dict[int, str],
) -> dict[str, Any]:
    """Goodput and the rest from one run's event lines."""
    lives: list[dict[str, Any]] = []
    policy: list[tuple[float, ...]] = []  # Goodput()'s (interval, cost, base) per save
    for e in events:
        if e[0] == "start":
            lives.append({"start": float(e[1]), "steps": [], "saves": [], "restored": None})
        elif not lives:
            continue
        elif e[0] == "restored" and len(e) == 3:
            lives[-1]["restored"] = (int(e[1]), float(e[2]))
        elif e[0] == "step" and len(e) == 4:
            lives[-1]["steps"].append((int(e[1]), float(e[2]), e[3]))
        elif e[0] == "saved" and len(e) == 3:
            lives[-1]["saves"].append((int(e[1]), float(e[2])))
        elif e[0] == "policy" and len(e) == 4:
            policy.append(tuple(float(x) for x in e[1:]))
    final = max((s[0] for s in lives[-1]["steps"]), default=0) if lives else 0
    if lives and lives[-1]["restored"] and not lives[-1]["steps"]:
        final = lives[-1]["restored"][0]
    lost, restore, intervals, dts = [], [], [], []
    mismatched = 0
    for i, life in enumerate(lives):
        if life["restored"] is not None:
            restore.append(life["restored"][1] - life["start"])
        if i + 1 < len(lives) and lives[i + 1]["restored"] is not None:
            begun = life["restored"][0] if life["restored"] else 0
            reached = max((s[0] for s in life["steps"]), default=begun)
            lost.append((reached - lives[i + 1]["restored"][0]) * base_step)
        times = [t for _, t in life["saves"]]
        intervals += [b - a for a, b in itertools.pairwise(times)]
        steps = life["steps"]
        dts += step_times(steps)
        mismatched += sum(1 for s, _, bits in steps if s in reference and reference[s] != bits)
    compared = sum(1 for life in lives for s, _, _ in life["steps"] if s in reference)

    def pct(xs: list[float], q: float) -> float | None:
        return float(np.percentile(xs, q)) if xs else None

    mean_dt = statistics.fmean(dts) if dts else None
    return {
        "goodput": final / (seconds * rate),
        "final_step": final,
        "failures": len(lives) - 1,
        "lost_s_p50": pct(lost, 50),
        "lost_s_p90": pct(lost, 90),
        "restore_s_p50": pct(restore[1:], 50),
        "restore_s_p90": pct(restore[1:], 90),
        "interval_s_p50": pct(intervals, 50),
        "saves": sum(len(life["saves"]) for life in lives),
        "step_s": mean_dt,
        "overhead_pct": 100 * (mean_dt / base_step - 1) if mean_dt else None,
        "losses_compared": compared,
        "losses_mismatched": mismatched,
        "bit_exact": mismatched == 0 and compared > 0,
        "policy_interval_s": policy[-1][0] if policy else None,
        "policy_save_cost_s": policy[-1][1] if policy else None,
        "policy_base_step_s": policy[-1][2] if policy else None,
    }


def calibrate(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The noop run (step rate, reference losses) and Orbax's effective save cost."""
    run = Run(args, "noop", work / "noop", [])
    run.go([], args.calibrate_seconds)
    events = parse(run.progress)
    steps = [(int(e[1]), float(e[2]), e[3]) for e in events if e[0] == "step" and len(e) == 4]
    dts = step_times(steps)
    base = statistics.median(dts)
    reference = {s: bits for s, _, bits in steps}
    if "orbax-yd" not in args.arms:
        return {"base_step_s": base, "steps_per_s": 1.0 / base, "orbax_cost_s": None,
                "noop_mean_step_s": statistics.fmean(dts), "reference_steps": len(reference),
                "_reference": reference}  # fmt: skip
    # Orbax every 5 steps: its steps' slowdown per save is its effective cost.
    every = 5
    orb = Run(args, "orbax-yd", work / "orbax-cal", ["--interval-steps", str(every)])
    orb.go([], args.calibrate_seconds)
    o_steps = [
        (int(e[1]), float(e[2])) for e in parse(orb.progress) if e[0] == "step" and len(e) == 4
    ]
    o_dts = step_times(o_steps)
    orbax_cost = max((statistics.fmean(o_dts) - base) * every, 0.0) if o_dts else 0.0
    return {
        "base_step_s": base,
        "steps_per_s": 1.0 / base,
        "noop_mean_step_s": statistics.fmean(dts),
        "reference_steps": len(reference),
        "orbax_cost_s": orbax_cost,
        "_reference": reference,
    }


def main(argv: list[str] | None = None) -> int:
    """Calibrate, run every cell, print the table, write JSON and the plot."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="wall time per arm and cell")
    ap.add_argument("--mtbf", type=float, nargs="+", default=[20.0, 60.0, 180.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--state-mib", type=int, default=256)
    ap.add_argument("--calibrate-seconds", type=float, default=None)
    ap.add_argument("--quick", action="store_true", help="45 s cells, MTBF 20 and 60, one seed")
    ap.add_argument("--daemon-args", default="", help="more `ckptd serve` flags, e.g. --io-nice 0")
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR / "goodput")
    ap.add_argument("--name", default="goodput", help="results: bench/results/NAME.json/.png")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.mtbf, args.seeds = 45.0, [20.0, 60.0], [1]
    # The reference must cover every step an arm can reach (goodput <= 1).
    args.calibrate_seconds = args.calibrate_seconds or args.seconds + 15.0
    cal = calibrate(args, args.work_dir)
    reference = cal.pop("_reference")
    # The job's restart cost in steps, from the calibration: none yet (measured per run).
    cells: list[dict[str, Any]] = []
    for mtbf in args.mtbf:
        cost = cal["orbax_cost_s"] or 0.0
        k = max(1, round(math.sqrt(2 * cost * mtbf) / cal["base_step_s"]))
        for seed in args.seeds:
            kills = kill_times(mtbf, args.seconds, seed)
            for arm in args.arms:
                extra = ["--mtbf", str(mtbf)] if arm == "ckptd-goodput" else []
                if arm == "orbax-yd":
                    extra = ["--interval-steps", str(k)]
                run = Run(args, arm, args.work_dir / f"{arm}-{mtbf:g}-{seed}", extra)
                try:
                    run.go(kills, args.seconds)
                finally:
                    run.close()
                row = summarize(
                    parse(run.progress),
                    run.start,
                    args.seconds,
                    cal["steps_per_s"],
                    cal["base_step_s"],
                    reference,
                )
                row.update(arm=arm, mtbf_s=mtbf, seed=seed, kills=len(kills))
                if arm == "orbax-yd":
                    row["orbax_interval_steps"] = k
                cells.append(row)
                print(
                    f"{arm:17} mtbf {mtbf:5g} seed {seed}: goodput {row['goodput']:.3f} "
                    f"({row['failures']} failures, bit-exact {row['bit_exact']})",
                    flush=True,
                )
    summary = summarize_cells(cells, args)
    headers = ["arm", "MTBF s", "goodput", "spread", "lost P50/P90 s", "restore P50/P90 s",
               "interval P50 s", "overhead %", "bit-exact"]  # fmt: skip
    rows = [row_of(s) for s in summary]
    print_table(headers, rows)
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "calibration": cal,
               "cells": cells, "summary": summary}  # fmt: skip
    path = write_results(args.name, results)
    plot(summary, RESULTS_DIR / f"{args.name}.png", cal)
    print(f"wrote {path} and {RESULTS_DIR / f'{args.name}.png'}")
    return 0


def row_of(s: dict[str, Any]) -> list[str]:
    """One summary line of the table."""
    return [
        s["arm"], f"{s['mtbf_s']:g}", f"{s['goodput']:.3f}",
        f"{s['goodput_min']:.3f}-{s['goodput_max']:.3f}",
        f"{fmt(s['lost_s_p50'])}/{fmt(s['lost_s_p90'])}",
        f"{fmt(s['restore_s_p50'])}/{fmt(s['restore_s_p90'])}",
        fmt(s["interval_s_p50"]), fmt(s["overhead_pct"], 1), str(s["bit_exact"]),
    ]  # fmt: skip


def fmt(v: float | None, digits: int = 2) -> str:
    """A number for the table, ``-`` for none."""
    return "-" if v is None else f"{v:.{digits}f}"


def summarize_cells(cells: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per (arm, MTBF): the median over schedules, and the spread."""
    out = []
    for mtbf in args.mtbf:
        for arm in args.arms:
            rs = [c for c in cells if c["arm"] == arm and c["mtbf_s"] == mtbf]
            if not rs:
                continue

            def med(key: str, rs: list[dict[str, Any]] = rs) -> float | None:
                xs = [r[key] for r in rs if r[key] is not None]
                return float(statistics.median(xs)) if xs else None

            g = [r["goodput"] for r in rs]
            out.append({
                "arm": arm, "mtbf_s": mtbf, "goodput": statistics.median(g),
                "goodput_min": min(g), "goodput_max": max(g), "runs": len(rs),
                "lost_s_p50": med("lost_s_p50"), "lost_s_p90": med("lost_s_p90"),
                "restore_s_p50": med("restore_s_p50"), "restore_s_p90": med("restore_s_p90"),
                "interval_s_p50": med("interval_s_p50"), "overhead_pct": med("overhead_pct"),
                "bit_exact": all(r["bit_exact"] for r in rs),
            })  # fmt: skip
    return out


def plot(summary: list[dict[str, Any]], path: Path, cal: dict[str, Any]) -> None:
    """Goodput against MTBF per arm, the spread as error bars."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[docs]'): no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in dict.fromkeys(s["arm"] for s in summary):
        rs = sorted((s for s in summary if s["arm"] == arm), key=lambda s: s["mtbf_s"])
        xs = [s["mtbf_s"] for s in rs]
        ys = [s["goodput"] for s in rs]
        err = [[y - s["goodput_min"] for y, s in zip(ys, rs, strict=True)],
               [s["goodput_max"] - y for y, s in zip(ys, rs, strict=True)]]  # fmt: skip
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=arm)
    ax.set_xscale("log")
    ax.set_xlabel("MTBF (s), trainer SIGKILLed at exponential times")
    ax.set_ylabel("goodput")
    ax.set_title(
        f"Goodput under failures: JAX MLP, {cal['base_step_s'] * 1e3:.0f} ms steps "
        "(median, min-max over schedules)",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
