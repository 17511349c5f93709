"""Goodput under failures: a real training job SIGKILLed at exponential times.

For each MTBF and failure schedule (a seed: the kill times, drawn once from an
exponential distribution and used for every arm), each arm runs the job of
bench/goodput/job.py for ``--seconds`` of wall time under this supervisor, which
kills it at those times and restarts it at once; the new process restores from
its arm's newest checkpoint and trains on. Before the arms, an uninterrupted
``noop`` run (no checkpointing) gives every step's loss, the reference each
arm's losses must equal bit for bit.

    goodput = useful steps / (wall seconds x failure-free steps per second)

where useful steps is the step the job has reached when the time is up, and the
failure-free rate is measured beside each run: a short ``noop`` run before every
arm's run and one after the last, a run's rate the mean of the two around it.
This VM's step time drifts by up to 2x over hours and by 15% between two
back-to-back identical runs, more than the arms differ by; a rate measured once
per matrix (or per group of arms) would credit or charge the drift to whichever
arm ran at the time. The arms' order rotates from group to group for the same
reason, and between runs
the finished run's checkpoints are deleted and every dirty page written back
(``sync``): Orbax writes through the page cache without fsync, and its dirty
pages (up to ``vm.dirty_ratio``, ~4.6 GiB here) would otherwise be written back
during the next arm's time. Per
cell: goodput (median and spread over the schedules), work lost per failure
(P50/P90, seconds), restore time (process start to state restored, P50/P90),
checkpoint interval (P50, seconds), step-time overhead against the noop run and
whether every step's loss equals the reference.

Arms: ``ckptd-goodput`` (``Goodput(mtbf_seconds=MTBF)``: told the failure rate),
``ckptd-learned`` (``Goodput()``: the failure rate learned from the daemon's record
of the job's restarts), ``ckptd-continuous`` (``Continuous()``, today's default),
``orbax-continuous`` (``ContinuousCheckpointingPolicy``) and ``orbax-yd``: Orbax
every k steps, k from Young/Daly with Orbax's *effective* cost of a save, measured
in a calibration run (every 5 steps; cost = the slowdown of its steps per save).
``--memory-tier off|both``: each ckptd arm also (both) or only (off) as
``<arm>-nomem``, its daemon's memory tier off (``--memory-tier-steps 0``: restarts
restore from disk). The table breaks restarts down: process start to state
restored, the restore call alone and its tier (memory/disk), start to first step.

Variants (``--variant``): ``trainer`` (the trainer process dies, the node and its
daemon live on: restores come from the local tier) and ``node`` (the node is
lost: at each failure the daemon is SIGKILLed too, its root wiped and a new
daemon started on the empty root, so ckptd restores from the bucket, a SeaweedFS
S3 server on 127.0.0.1 that the arms' daemons drain to; Orbax's directory is
left in place, standing in for a durable file system or bucket that it writes
at local-disk speed, which flatters Orbax). In the node variant ``Goodput()`` is
given the failure rate as ``node_mtbf_seconds`` and waits for ``"durable"``.

``--framework torch`` runs the same model in PyTorch (bench/goodput/torch_job.py):
``dcp.async_save`` through ckptd's ``CkptdWriter`` under the ckptd policies, and
``dcp-yd``: DCP's ``FileSystemWriter`` every k steps, k from Young/Daly with its
effective cost measured the same way.

Results: a table on stdout, bench/results/NAME.json and a plot,
bench/results/NAME.png (NAME: ``goodput``, ``goodput-node``, ``goodput-torch``).
``--quick`` (``make goodput``) is a short version.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from report import (
    CAL_EVERY,
    HEADERS,
    calibration,
    parse,
    plot,
    row_of,
    step_times,
    still_restoring,
    summarize,
    summarize_cells,
)
from sim_inputs import kill_times

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))  # tests.servers: the SeaweedFS server of the node variant
from common import DEFAULT_WORK_DIR, RESULTS_DIR, print_table, write_results  # noqa: E402

from ckptd.daemon.app.launcher import DaemonProcess as Daemon  # noqa: E402
from ckptd.daemon.local.segments import recorded_dir  # noqa: E402

QUICK_ARMS = ["ckptd-learned", "orbax-continuous", "orbax-yd"]
ARMS = ("ckptd-goodput", "ckptd-learned", "ckptd-continuous", "orbax-continuous", "orbax-yd")
TORCH_ARMS = ("ckptd-goodput", "ckptd-learned", "ckptd-continuous", "dcp-yd")
NOMEM = "-nomem"
"""An arm's name with the daemon's memory tier off (--memory-tier)."""
YD_ARMS = {"orbax-yd": "orbax-interval", "dcp-yd": "dcp-interval"}
"""Arms saving every k steps, k from Young/Daly with the cost calibrate() measures."""
BUCKET = "goodput"


class Run:
    """One arm under one failure schedule (``s3``: the node variant's bucket server)."""

    def __init__(
        self,
        args: argparse.Namespace,
        arm: str,
        work: Path,
        extra: list[str],
        s3: Any = None,
        fresh: bool = True,
    ) -> None:
        self.args, self.arm, self.work, self.s3 = args, arm, work, s3
        if fresh:  # else: a finished run's files, summarised again (--resummarize)
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
        self.progress = work / "progress.log"
        base = arm.removesuffix(NOMEM)
        self.daemon: Daemon | None = None
        self.node_losses: list[float] = []  # seconds from the kill to the new daemon ready
        self.cmd = [
            sys.executable,
            str(HERE / ("torch_job.py" if args.framework == "torch" else "job.py")),
            "--arm",
            YD_ARMS.get(base, base),
            "--progress",
            str(self.progress),
            "--state-mib",
            str(args.state_mib),
            "--dir",
            str(work / "orbax"),
            *(["--ballast-mib", str(args.ballast_mib)] if args.ballast_mib else []),
            *(["--trainer", args.trainer] if args.trainer != "jax" else []),
            *extra,
        ]
        if arm.startswith("ckptd"):
            daemon_args = ["--retention-local", "KeepLatest(2)"]
            if arm.endswith(NOMEM):
                daemon_args += ["--memory-tier-steps", "0"]
            env: dict[str, str] = {}
            if s3 is not None:
                # Each run its own prefix in the one bucket; the node keeps its name
                # across the loss (a replacement node takes the lost one's place).
                daemon_args += ["--remote", f"s3://{BUCKET}/{work.name}", "--node-id", "node0",
                                "--retention-remote", "KeepLatest(2)"]  # fmt: skip
                env = s3.env()
            self.daemon = Daemon(
                work / "root",
                work / "ckptd.sock",
                extra_args=[*daemon_args, *args.daemon_args.split()],
                env=env,
                log_path=work / "ckptd.log",
                start_timeout=120.0,
                # Room for the memory tier's kept step and the saves in flight.
                staging_budget=f"{max(512, 4 * (args.state_mib + args.ballast_mib))}MiB",
            )
            self.cmd += ["--socket", str(self.daemon.socket)]

    def go(self, kills: list[float], seconds: float) -> list[float]:
        """Run for ``seconds``, SIGKILLing the job at ``kills`` (and, in the node
        variant, losing the node); returns the kill times (unix)."""
        self._daemon_up()
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
                if self.s3 is not None:
                    self.lose_node()
                proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=self._errlog())
        self.start = start
        return done[:-1]

    def lose_node(self) -> None:
        """The node is gone: its daemon dies, its disk and shared memory with it; a new
        daemon starts on an empty root (ckptd arms; Orbax's directory stays)."""
        if self.daemon is None:
            return
        t0 = time.time()
        self.daemon.kill()
        seg_dir = recorded_dir(self.daemon.root)  # named in the root: read it first
        shutil.rmtree(self.daemon.root, ignore_errors=True)
        # The dead daemon's segments would survive in /dev/shm; a lost node's do not.
        if seg_dir is not None:
            shutil.rmtree(seg_dir, ignore_errors=True)
        self.daemon.start()
        self.node_losses.append(time.time() - t0)

    def final_step(self) -> int | None:
        """The step a restart now would resume from (the newest checkpoint), for a run
        whose last process was still restoring when the time was up: what a job
        started with ``--max-steps 0`` (restore, then exit) restores."""
        saved = self.work / "final_step"  # the probe's answer, kept for --resummarize
        if saved.exists():
            return int(saved.read_text()) if saved.read_text() else None
        self._daemon_up()
        probe = self.work / "probe.log"
        probe.unlink(missing_ok=True)
        cmd = list(self.cmd)
        cmd[cmd.index("--progress") + 1] = str(probe)
        subprocess.run([*cmd, "--max-steps", "0"], stdout=subprocess.DEVNULL,
                       stderr=self._errlog(), timeout=600, check=False)  # fmt: skip
        restored = [int(e[1]) for e in parse(probe) if e[0] == "restored" and len(e) == 3]
        saved.write_text(str(restored[-1]) if restored else "")
        return restored[-1] if restored else None

    def _daemon_up(self) -> None:
        if self.daemon is not None and not self.daemon.running():
            self.daemon.start()

    def _errlog(self) -> Any:
        return (self.work / "job.err").open("ab")

    def close(self) -> None:
        """Stop the daemon (if any)."""
        if self.daemon is not None:
            self.daemon.stop()

    def settle(self) -> None:
        """After the run: its checkpoints deleted (the event files kept, for
        --resummarize) and every dirty page written back, so the next run does not
        pay for this one's writeback."""
        if self.args.resummarize:
            return
        for name in ("orbax", "root"):
            shutil.rmtree(self.work / name, ignore_errors=True)
        os.sync()


def noop_step(args: argparse.Namespace, index: int) -> float:
    """The failure-free step time now: the median step of a short ``noop`` run (the
    ``index``-th: before the index-th arm's run)."""
    run = Run(args, "noop", args.work_dir / f"noop-{index}", [], fresh=not args.resummarize)
    if not args.resummarize:
        run.go([], args.noop_seconds)
        run.settle()
    steps = [(int(e[1]), float(e[2])) for e in parse(run.progress)
             if e[0] == "step" and len(e) == 4]  # fmt: skip
    if not step_times(steps):
        sys.exit(f"the noop run {run.work} timed no step: raise --noop-seconds")
    return statistics.median(step_times(steps))


def calibrate(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The uninterrupted runs: ``noop`` (step rate, reference losses) and the Young/Daly
    arm saving every 5 steps (its effective save cost)."""
    runs = [Run(args, "noop", work / "noop", [])]
    yd = [a for a in args.arms if a in YD_ARMS]
    if yd:
        runs.append(Run(args, yd[0], work / "yd-cal", ["--interval-steps", str(CAL_EVERY)]))
    for run in runs:
        run.go([], args.calibrate_seconds)
        run.settle()
    return calibration(work)


def run_cells(
    args: argparse.Namespace, cal: dict[str, Any], reference: dict[int, str], s3: Any
) -> list[dict[str, Any]]:
    """Every (MTBF, schedule, arm) run, summarised against the failure-free rate
    measured around its group (see the module)."""
    groups = [(mtbf, seed) for mtbf in args.mtbf for seed in args.seeds]
    bases: list[float] = []  # the noop runs' step times: bases[i] before run i
    done: list[tuple[int, dict[str, Any], list[list[str]], int | None]] = []
    for g, (mtbf, seed) in enumerate(groups):
        cost = cal["yd_cost_s"] or 0.0
        k = max(1, round(math.sqrt(2 * cost * mtbf) / cal["base_step_s"]))
        kills = kill_times(mtbf, args.seconds, seed)
        turn = g % len(args.arms)
        for arm in [*args.arms[turn:], *args.arms[:turn]]:
            extra: list[str] = []
            if arm.removesuffix(NOMEM) == "ckptd-goodput":
                extra = ["--node-mtbf" if s3 is not None else "--mtbf", str(mtbf)]
            if arm in YD_ARMS:
                extra = ["--interval-steps", str(k)]
            i = len(done)
            bases.append(noop_step(args, i))
            where = args.work_dir / f"{arm}-{mtbf:g}-{seed}"
            run = Run(args, arm, where, extra, s3, fresh=not args.resummarize)
            try:
                if not args.resummarize:
                    run.go(kills, args.seconds)
                events = parse(run.progress)
                final = run.final_step() if still_restoring(events) else None
            finally:
                run.close()
                run.settle()
            meta: dict[str, Any] = {
                "arm": arm,
                "mtbf_s": mtbf,
                "seed": seed,
                "kills": len(kills),
                "node_restart_s": run.node_losses,
            }
            if arm in YD_ARMS:
                meta["yd_interval_steps"] = k
            done.append((i, meta, events, final))
            rough = summarize(events, args.seconds, 1 / bases[i], bases[i], reference, final)
            print(
                f"{arm:17} mtbf {mtbf:5g} seed {seed}: goodput {rough['goodput']:.3f} "
                f"(against the noop before it; {rough['failures']} failures, "
                f"bit-exact {rough['bit_exact']})",
                flush=True,
            )
    bases.append(noop_step(args, len(done)))
    cells: list[dict[str, Any]] = []
    for i, meta, events, final in done:
        base = (bases[i] + bases[i + 1]) / 2
        row = summarize(events, args.seconds, 1 / base, base, reference, final)
        once = summarize(events, args.seconds, cal["steps_per_s"], cal["base_step_s"],
                         reference, final)  # fmt: skip
        row.update(meta, noop_step_s=base, goodput_vs_calibration=once["goodput"])
        cells.append(row)
    return cells


def main(argv: list[str] | None = None) -> int:
    """Calibrate, run every cell, print the table, write JSON and the plot."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="wall time per arm and cell")
    ap.add_argument("--mtbf", type=float, nargs="+", default=[20.0, 60.0, 180.0],
                    help="mean seconds between failures, one cell each")  # fmt: skip
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3],
                    help="failure schedules (the kill times' random seeds)")  # fmt: skip
    ap.add_argument("--framework", choices=("jax", "torch"), default="jax",
                    help="the job: job.py (JAX, Orbax) or torch_job.py (PyTorch, DCP)")  # fmt: skip
    ap.add_argument("--arms", nargs="+", default=None, choices=sorted({*ARMS, *TORCH_ARMS}),
                    help="default: every arm of the framework")  # fmt: skip
    ap.add_argument("--variant", choices=("trainer", "node"), default="trainer",
                    help="trainer: the process dies; node: its daemon and disk too")  # fmt: skip
    ap.add_argument("--state-mib", type=int, default=256, help="the job's state size")
    ap.add_argument("--trainer", choices=("jax", "gpu-like"), default="jax",
                    help="JAX job: the JAX MLP or gpu_like.py's GPU stand-in")  # fmt: skip
    ap.add_argument("--ballast-mib", type=int, default=0,
                    help="JAX job: state no step touches (bigger restores)")  # fmt: skip
    ap.add_argument("--memory-tier", choices=("on", "off", "both"), default="on",
                    help=f"the ckptd arms' daemon memory tier; off/both: arms named "
                    f"<arm>{NOMEM} run with it off")  # fmt: skip
    ap.add_argument("--noop-seconds", type=float, default=None,
                    help="the failure-free runs around each arm's (20; --quick: 12)")  # fmt: skip
    ap.add_argument("--calibrate-seconds", type=float, default=None,
                    help="the uninterrupted runs' length (default: --seconds + 15)")  # fmt: skip
    ap.add_argument("--quick", action="store_true",
                    help="40 s cells, MTBF 20 and 60, one seed (JAX: the default policy and "
                    "Orbax's two arms)")  # fmt: skip
    ap.add_argument("--daemon-args", default="", help="more `ckptd serve` flags, e.g. --io-nice 0")
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR / "goodput")
    ap.add_argument("--resummarize", action="store_true",
                    help="no runs: the table, JSON and plot again from the work dir's files "
                    "(the same other arguments as the run)")  # fmt: skip
    ap.add_argument("--name", default=None,
                    help="results: bench/results/NAME.json/.png (goodput[-node])")  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:  # the default policy against the two Orbax arms, under 10 minutes
        args.seconds, args.mtbf, args.seeds = 40.0, [20.0, 60.0], [1]
        args.noop_seconds = args.noop_seconds or 12.0
        args.arms = args.arms or (QUICK_ARMS if args.framework == "jax" else None)
    if args.framework == "torch" and args.variant == "node":
        ap.error("the node variant runs the JAX job only")
    if args.framework == "torch" and args.ballast_mib:
        ap.error("--ballast-mib is an option of the JAX job only")
    if args.trainer != "jax" and (args.framework == "torch" or args.ballast_mib):
        ap.error("--trainer gpu-like runs with the JAX job (--framework jax), without ballast")
    args.noop_seconds = args.noop_seconds or 20.0
    known = TORCH_ARMS if args.framework == "torch" else ARMS
    args.arms = args.arms or list(known)
    if unknown := [a for a in args.arms if a not in known]:
        ap.error(f"not arms of the {args.framework} job: {unknown}")
    tiers = {"on": [""], "off": [NOMEM], "both": ["", NOMEM]}[args.memory_tier]
    args.arms = [arm + t for arm in args.arms for t in (tiers if arm.startswith("ckptd") else [""])]
    suffix = {"node": "-node"}.get(args.variant, "") + (
        "-torch" if args.framework == "torch" else ""
    )
    args.name = args.name or f"goodput{suffix}"
    args.work_dir = args.work_dir / args.name  # each result's runs kept apart
    # The reference must cover every step an arm can reach (goodput <= 1).
    args.calibrate_seconds = args.calibrate_seconds or args.seconds + 15.0
    cal = calibration(args.work_dir) if args.resummarize else calibrate(args, args.work_dir)
    reference = cal.pop("_reference")
    s3 = None
    try:
        if args.variant == "node":
            from tests.servers import SeaweedS3

            s3 = SeaweedS3(args.work_dir / "seaweed", volume_size_limit_mb=8192).start()
            s3.make_bucket(BUCKET)
        cells = run_cells(args, cal, reference, s3)
    finally:
        if s3 is not None:
            s3.close()
    summary = summarize_cells(cells, args)
    print_table(HEADERS, [row_of(s) for s in summary], title=f"variant: {args.variant}")
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "calibration": cal,
               "cells": cells, "summary": summary}  # fmt: skip
    path = write_results(args.name, results)
    plot(summary, RESULTS_DIR / f"{args.name}.png", cal, args.variant, args.framework)
    print(f"wrote {path} and {RESULTS_DIR / f'{args.name}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
