"""Continuous checkpointing: ckptd ``Continuous()`` vs Orbax ``ContinuousCheckpointingPolicy``.

A synthetic training loop runs for ``--seconds`` of wall time per arm, the arms
one after the other in one process, with the same loop code and the same state:

- ``noop``: no checkpointing (the baseline for step-time overhead);
- ``ckptd``: a real ``ckptd serve`` daemon (local tier, ``KeepLatest(2)``),
  ``Client(policy=Continuous())``, ``if client.should_save(step): client.save(step, state)``;
- ``orbax``: ``CheckpointManager`` with ``ContinuousCheckpointingPolicy()``,
  ``max_to_keep=2``, async saves, the same numpy state, on the same disk.

Each step is fixed CPU work on ONE thread (512x512 float32 matmuls, BLAS pinned
to one thread), calibrated at start so that it plus the update take
``--step-ms``, then an in-place update of every element of the ``--state-mib``
float32 state. It stands for an accelerator-bound loop whose host has a core
free for checkpoint work. Each checkpointing arm first makes an untimed save of
step 0 and waits for it. Results: a table on stdout and
``bench/results/continuous.json``. See bench/README.md.
"""

from __future__ import annotations

import os

# The trainer's compute is ONE thread: pin BLAS before numpy is imported (the other
# core is left to checkpoint work, as on a host whose accelerator does the compute).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from common import (  # noqa: E402
    DEFAULT_WORK_DIR,
    Daemon,
    print_table,
    run_directory,
    settle,
    write_results,
)

JOB = "bench-continuous"
ARMS = ("noop", "ckptd", "orbax")
DELTA = np.float32(1e-3)
State = dict[str, np.ndarray]
# fmt: off
COLUMNS = [  # (header, key in the arm's summary)
    ("steps", "steps"), ("step s", "mean_step_s"), ("ovh %", "overhead_pct"),
    ("steps/min", "steps_per_min"), ("saves", "saves"), ("saves/min", "saves_per_min"),
    ("int P50 st", "interval_steps_p50"), ("int P90 st", "interval_steps_p90"),
    ("int P50 s", "interval_s_p50"), ("int P90 s", "interval_s_p90"),
    ("block P50 s", "save_block_s_p50"), ("block max s", "save_block_s_max"),
    ("decide s", "should_save_s_total"), ("last wait s", "final_wait_s"),
]
# fmt: on


@dataclass
class Record:
    """Raw timings of one arm (seconds; times are relative to the loop's start)."""

    step_starts: list[float] = field(default_factory=list)
    save_steps: list[int] = field(default_factory=list)
    save_times: list[float] = field(default_factory=list)
    block_s: list[float] = field(default_factory=list)
    decide_s: float = 0.0
    loop_s: float = 0.0
    final_wait_s: float = 0.0
    warmup_s: float | None = None
    cpu_s: dict[str, float] = field(default_factory=dict)


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_state(nbytes: int, n_arrays: int) -> State:
    """``n_arrays`` float32 arrays of equal size (rows of 1024) totalling about ``nbytes``."""
    rows = max(1, nbytes // n_arrays // 4096)
    rng = np.random.default_rng(0)
    return {f"layer{i:02d}": rng.random((rows, 1024), dtype=np.float32) for i in range(n_arrays)}


def update(state: State) -> None:
    """Read and write every element of the state, in place."""
    for a in state.values():
        a += DELTA


class Work:
    """The trainer's fixed compute: ``iters`` single-threaded 512x512 float32 matmuls."""

    def __init__(self) -> None:
        rng = np.random.default_rng(1)
        self.a = rng.random((512, 512), dtype=np.float32)
        self.b = rng.random((512, 512), dtype=np.float32)
        self.out = np.empty_like(self.a)
        self.iters = 0

    def run(self, iters: int | None = None) -> None:
        """One step's compute (BLAS releases the GIL during each ~3 ms call)."""
        for _ in range(self.iters if iters is None else iters):
            np.matmul(self.a, self.b, out=self.out)

    def step(self, state: State) -> None:
        """One whole step: the compute, then the update of the state."""
        self.run()
        update(state)

    def step_time(self, state: State) -> float:
        """Median wall time of 5 whole steps, no saves."""
        return statistics.median(timed(lambda: self.step(state)) for _ in range(5))

    def calibrate(self, step_s: float, state: State) -> None:
        """Pick ``iters`` so that compute + update take about ``step_s``."""
        per_iter = statistics.median(timed(lambda: self.run(10)) for _ in range(5)) / 10
        for _ in range(3):  # refine against whole steps
            self.iters = max(0, round(self.iters + (step_s - self.step_time(state)) / per_iter))


def cpu_times(pid: int | None) -> dict[str, float]:
    """CPU seconds so far: this process, its main (trainer) thread, and process ``pid``."""
    t = os.times()
    out = {"process": t.user + t.system, "trainer_thread": time.thread_time()}
    if pid is not None:
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out["daemon"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


class CkptdSaver:
    """A real daemon (local tier only, ``KeepLatest(2)``) and a ``Continuous()`` client."""

    def __init__(self, run_dir: Path) -> None:
        from ckptd.client import Client, Continuous

        self.daemon = Daemon(
            run_dir / "ckptd-root",
            run_dir / "ckptd.sock",
            extra_args=["--retention-local", "KeepLatest(2)"],
        ).start()
        try:
            self.client = Client(job=JOB, socket=str(self.daemon.socket), policy=Continuous())
        except BaseException:
            self.daemon.stop()
            raise
        self.handle: Any = None
        self.pid = self.daemon.proc.pid if self.daemon.proc else None  # its CPU is counted
        self.info: dict[str, Any] = {"daemon_args": self.daemon.args[1:]}

    def warmup(self, state: State) -> None:
        """Save step 0 and wait for LOCAL (the daemon allocates its staging lease)."""
        self.client.save(0, state).wait("local")

    def should_save(self, step: int) -> bool:
        """``client.should_save``: the previous save is LOCAL and there is room."""
        return bool(self.client.should_save(step))

    def save(self, step: int, state: State) -> bool:
        """``client.save``: returns once the state is copied into shared memory."""
        self.handle = self.client.save(step, state)
        return True

    def finish(self) -> None:
        """Wait for the last save to reach LOCAL."""
        if self.handle is not None:
            self.handle.wait("local")

    def close(self) -> None:
        """Close the client and stop the daemon."""
        self.client.close()
        rc = self.daemon.stop()
        if rc not in (0, None):
            self.info["daemon_exit_status"] = rc


class OrbaxSaver:
    """``ocp.CheckpointManager`` with ``ContinuousCheckpointingPolicy()`` and async saves."""

    def __init__(self, run_dir: Path) -> None:
        import jax
        import orbax.checkpoint as ocp

        self.ocp = ocp
        policy = ocp.checkpoint_managers.ContinuousCheckpointingPolicy()
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policy, max_to_keep=2, enable_async_checkpointing=True
        )
        self.mngr = ocp.CheckpointManager(run_dir / "orbax", options=options)
        self.pid = None
        self.info = {
            "orbax_checkpoint": getattr(ocp, "__version__", None),
            "jax": jax.__version__,
            "policy": repr(policy),
            "leaves": "numpy.ndarray (NumpyHandler deep-copies host arrays inside save())",
        }

    def warmup(self, state: State) -> None:
        """Save step 0 and wait for it (directories, imports, thread pools)."""
        self.mngr.save(0, args=self.ocp.args.StandardSave(state), force=True)
        self.mngr.wait_until_finished()

    def should_save(self, step: int) -> bool:
        """``mngr.should_save``: no save in progress."""
        return bool(self.mngr.should_save(step))

    def save(self, step: int, state: State) -> bool:
        """``mngr.save`` with ``StandardSave``; returns whether it started a save."""
        return bool(self.mngr.save(step, args=self.ocp.args.StandardSave(state)))

    def finish(self) -> None:
        """Wait for the last save to be committed."""
        self.mngr.wait_until_finished()

    def close(self) -> None:
        """Close the manager."""
        self.mngr.close()


def run_arm(
    saver: CkptdSaver | OrbaxSaver | None, state: State, work: Work, seconds: float
) -> Record:
    """Warm up, then run steps for ``seconds`` of wall time, saving when the policy says so."""
    rec = Record()
    if saver is not None:
        rec.warmup_s = timed(lambda: saver.warmup(state))
    settle()
    pid = saver.pid if saver is not None else None
    cpu0 = cpu_times(pid)
    perf = time.perf_counter
    t0 = perf()
    step = 0
    while (now := perf()) - t0 < seconds:
        step += 1
        rec.step_starts.append(now - t0)
        work.step(state)
        if saver is None:
            continue
        td = perf()
        if not saver.should_save(step):
            rec.decide_s += perf() - td
            continue
        ts = perf()
        rec.decide_s += ts - td
        if saver.save(step, state):
            rec.block_s.append(perf() - ts)
            rec.save_steps.append(step)
            rec.save_times.append(ts - t0)
    rec.loop_s = perf() - t0
    rec.cpu_s = {k: v - cpu0[k] for k, v in cpu_times(pid).items() if k in cpu0}
    if saver is not None:
        rec.final_wait_s = timed(saver.finish)
    return rec


def pct(values: list[float] | np.ndarray, q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), None if there are no values."""
    return float(np.percentile(values, q)) if len(values) else None


def summarize_arm(rec: Record) -> dict[str, Any]:
    """Interval percentiles, mean step time, rates, save blocking and CPU of one arm."""
    steps, saves, minutes = len(rec.step_starts), len(rec.save_steps), rec.loop_s / 60
    d_steps, d_secs = np.diff(rec.save_steps).astype(float), np.diff(rec.save_times)
    return {
        "steps": steps,
        "loop_seconds": rec.loop_s,
        "mean_step_s": rec.loop_s / steps if steps else None,
        "steps_per_min": steps / minutes if minutes else None,
        "saves": saves,
        "saves_per_min": saves / minutes if minutes else None,
        "interval_steps_p50": pct(d_steps, 50),
        "interval_steps_p90": pct(d_steps, 90),
        "interval_s_p50": pct(d_secs, 50),
        "interval_s_p90": pct(d_secs, 90),
        "save_block_s_p50": pct(rec.block_s, 50),
        "save_block_s_p90": pct(rec.block_s, 90),
        "save_block_s_max": max(rec.block_s) if rec.block_s else None,
        "save_block_s_total": sum(rec.block_s),
        "should_save_s_total": rec.decide_s,
        "final_wait_s": rec.final_wait_s if saves else None,
        "warmup_save_s": rec.warmup_s,
        "cpu_s_in_loop": rec.cpu_s,
        "cpu_cores_in_loop": {k: v / rec.loop_s for k, v in rec.cpu_s.items()} if steps else {},
    }


def goals(arms: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's two goals, each met / not met (None where an arm is missing)."""
    c, o = arms.get("ckptd", {}), arms.get("orbax", {})
    out = []
    for name, key, factor in (
        ("ckptd P50 interval (steps) <= 0.5x Orbax's", "interval_steps_p50", 0.5),
        ("ckptd step-time overhead <= Orbax's", "overhead_pct", 1.0),
    ):
        value, ref = c.get(key), o.get(key)
        limit = None if ref is None else factor * ref
        met = None if value is None or limit is None else value <= limit
        out.append({"goal": name, "ckptd": value, "limit": limit, "met": met})
    return out


def report(
    args: argparse.Namespace, setup: dict[str, Any], records: dict[str, Record]
) -> dict[str, Any]:
    """Print the tables and the goals; returns the JSON document (less machine info)."""
    arms = {name: summarize_arm(rec) for name, rec in records.items()}
    base = arms.get("noop", {}).get("mean_step_s")
    for s in arms.values():
        mean = s["mean_step_s"]
        s["overhead_pct"] = 100 * (mean / base - 1) if base and mean else None
    loop = (
        f"each step = {setup['compute_s'] * 1e3:.0f} ms of one-thread CPU compute + "
        f"{setup['update_s'] * 1e3:.0f} ms in-place update of the whole state; stands for an "
        f"accelerator-bound loop whose host has a core free for checkpoint work "
        f"(nproc={os.cpu_count()})"
    )
    title = (
        f"continuous checkpointing: {setup['state_bytes'] / 2**20:.0f} MiB float32 state in "
        f"{args.arrays} arrays, {args.seconds:.0f} s per arm; {loop}"
    )
    rows = [[name, *(s[k] for _, k in COLUMNS)] for name, s in arms.items()]
    print_table(["arm", *(h for h, _ in COLUMNS)], rows, title)
    print(
        "int = interval between consecutive saves; block = time inside client.save() / "
        "mngr.save(); decide = total time in should_save(); last wait = for the last save "
        "after the loop (not in step time)"
    )
    cpu_keys = ("process", "trainer_thread", "daemon")
    cpu_rows = [
        [name, *(s["cpu_cores_in_loop"].get(k) for k in cpu_keys)] for name, s in arms.items()
    ]
    heads = ["arm", "this process", "its trainer thread", "ckptd daemon"]
    print_table(heads, cpu_rows, "CPU during the loop (cores busy, on average)")
    status = {None: "-", True: "met", False: "NOT met"}
    goal_rows = goals(arms)
    table = [[g["goal"], g["ckptd"], g["limit"], status[g["met"]]] for g in goal_rows]
    print_table(["goal", "ckptd", "limit", "status"], table, "goals")
    raw = {
        name: {
            "save_steps": rec.save_steps,
            "save_start_s": [round(t, 6) for t in rec.save_times],
            "save_block_s": [round(t, 6) for t in rec.block_s],
            "step_start_s": [round(t, 6) for t in rec.step_starts],
        }
        for name, rec in records.items()
    }
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {
        "config": config,
        "setup": setup,
        "loop": loop + "; every checkpointing arm first saves step 0 (untimed, waited for)",
        "unit": "seconds",
        "arms": arms,
        "goals": goal_rows,
        "raw": raw,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--seconds", type=float, help="wall time per arm (default 180; --quick 20)")
    p.add_argument("--state-mib", type=int, help="state size in MiB (default 256; --quick 64)")
    p.add_argument("--arrays", type=int, default=4, help="arrays in the state (default 4)")
    p.add_argument("--step-ms", type=float, default=100.0, help="step time, no saves (default 100)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {ARMS}")
    p.add_argument("--quick", action="store_true", help="20 s arms, 64 MiB state")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch dir (same disk)")
    p.add_argument("--name", default="continuous", help="results file bench/results/NAME.json")
    args = p.parse_args(argv)
    args.seconds = args.seconds or (20.0 if args.quick else 180.0)
    args.state_mib = args.state_mib or (64 if args.quick else 256)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not args.arms or any(a not in ARMS for a in args.arms):
        p.error(f"--arms must be a comma-separated subset of {','.join(ARMS)}")
    if args.seconds <= 0 or args.state_mib <= 0 or args.arrays < 1 or args.step_ms <= 0:
        p.error("--seconds, --state-mib, --arrays and --step-ms must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally clause runs
    args.dir = args.dir.resolve()
    with run_directory(args.dir, "continuous") as run_dir:
        saver: CkptdSaver | OrbaxSaver | None = None
        try:
            state = make_state(args.state_mib * 2**20, args.arrays)
            update(state)  # touch it once
            work = Work()
            work.calibrate(args.step_ms / 1e3, state)
            setup: dict[str, Any] = {
                "state_bytes": sum(a.nbytes for a in state.values()),
                "compute_matmuls": work.iters,
                "compute_s": statistics.median(timed(work.run) for _ in range(5)),
                "update_s": statistics.median(timed(lambda: update(state)) for _ in range(5)),
                "step_s": work.step_time(state),
                "arm_info": {},
            }
            print(
                f"calibrated: compute {setup['compute_s'] * 1e3:.1f} ms ({work.iters} matmuls), "
                f"update {setup['update_s'] * 1e3:.1f} ms, step {setup['step_s'] * 1e3:.1f} ms"
            )
            records: dict[str, Record] = {}
            for arm in args.arms:
                print(f"arm {arm}: {args.seconds:.0f} s ...", flush=True)
                saver = CkptdSaver(run_dir) if arm == "ckptd" else None
                saver = OrbaxSaver(run_dir) if arm == "orbax" else saver
                records[arm] = rec = run_arm(saver, state, work, args.seconds)
                if saver is not None:
                    done, saver = saver, None
                    done.close()
                    setup["arm_info"][arm] = done.info
                print(f"arm {arm}: {len(rec.step_starts)} steps, {len(rec.save_steps)} saves")
            doc = report(args, setup, records)
            print(f"results: {write_results(args.name, doc, work_dir=args.dir)}")
            return 0
        except BaseException:
            if isinstance(saver, CkptdSaver):
                print("daemon log tail:\n" + saver.daemon.log_tail(), file=sys.stderr)
            raise
        finally:
            if saver is not None:
                with contextlib.suppress(Exception):
                    saver.close()


if __name__ == "__main__":
    sys.exit(main())
