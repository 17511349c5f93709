"""A transformer-shaped training state: ckptd against its floors, DCP and Orbax, in one run.

Two states of the same size (``--gib``, default 1): a decoder-only transformer's
parameters plus Adam's two moments (~1,500 arrays, from 1.5 KiB biases and norms
to the embedding; ``transformer_arms.transformer_state``), and the same bytes in
8 equal float32 arrays, the shape the 8-array goals were met on. On each state,
interleaved repetitions of:

- ckptd: ``save()`` return; handoff to LOCAL (``save()`` + ``wait("local")``);
  the daemon's CPU seconds for that save; a restore from the local tier (files
  evicted from the page cache first) plus a read of every byte;
- floors, the same kind of work (``bench_tensors``): a 2-thread memcpy into a
  touched buffer (``save()``); the memcpy plus an ``O_DIRECT`` overwrite of a
  preallocated file + fsync (LOCAL); an ``O_DIRECT`` read into a touched buffer
  plus crc32c (restore);
- PyTorch DCP (one process, no process group): ``save`` (returns written and
  fsynced), ``async_save`` (return, then the future), cold ``load`` into
  touched tensors plus a read of every byte;
- Orbax ``StandardCheckpointer``: ``save`` return, ``wait_until_finished``, and
  that plus an fsync of its files; cold ``restore`` plus a read of every byte.

A table on stdout and ``bench/results/transformer.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from bench_tensors import cpu_seconds, memcpy2, overwrite_direct, read_direct_crc
from common import (
    DEFAULT_WORK_DIR,
    Daemon,
    drop_caches,
    print_table,
    run_directory,
    settle,
    summarize,
    write_results,
)
from floors import packed_offsets, packed_size, round_up, touch, touched_buffer
from transformer_arms import (
    DcpArm,
    OrbaxArm,
    Tree,
    check_equal,
    eight_array_state,
    leaves,
    param_dtype,
    transformer_state,
)

from ckptd.client import Client

GROUPS = ("ckptd", "floors", "dcp", "orbax")
STATES = ("transformer", "8arrays")
ROWS = (  # (label, ckptd arm, floor arm)
    ("save() returns", "save", "floor_memcpy"),
    ("handoff -> LOCAL", "local", "floor_memcpy_write"),
    ("cold restore + touch", "restore", "floor_read_crc"),
)
FLOOR_NAMES = {
    "floor_memcpy": "2-thread memcpy into a touched buffer",
    "floor_memcpy_write": "memcpy + O_DIRECT overwrite of a preallocated file + fsync",
    "floor_read_crc": "O_DIRECT read into a touched buffer + crc32c",
}
GOALS = {"save": 1.2, "local": 1.2, "restore": 1.3}


class StateRun:
    """One state with its client, floor buffer and file, and the peer arms."""

    def __init__(
        self, name: str, state: Tree, run: Path, daemon: Daemon, groups: list[str]
    ) -> None:
        self.name, self.state, self.daemon = name, state, daemon
        self.arrays = list(leaves(state))
        self.nbytes = sum(a.nbytes for a in self.arrays)
        self.offsets = packed_offsets(self.arrays)
        self.size = packed_size(self.arrays)
        self.buf = touched_buffer(self.size)
        self.floor_file = run / f"floor-{name}.bin"
        with open(self.floor_file, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, round_up(self.size))
        self.client = Client(f"tf-{name}", socket=daemon.socket)
        self.dcp = DcpArm(state, run, name) if "dcp" in groups else None
        self.orbax = OrbaxArm(state, run, name) if "orbax" in groups else None
        self.step = 0

    def ckptd(self) -> dict[str, float]:
        """save(), LOCAL and daemon CPU; then a cold restore + touch, checked."""
        assert self.daemon.proc is not None
        pid = self.daemon.proc.pid
        settle()
        cpu0 = cpu_seconds(pid)
        t0 = time.perf_counter()
        handle = self.client.save(self.step, self.state)
        t1 = time.perf_counter()
        handle.wait("local")
        t2 = time.perf_counter()
        cpu1 = cpu_seconds(pid)
        drop_caches(self.daemon.root)
        settle()
        cpu2 = cpu_seconds(pid)
        t3 = time.perf_counter()
        restored, _ = self.client.restore(step=self.step)
        t_ret = time.perf_counter()
        touch(list(leaves(restored)))
        t4 = time.perf_counter()
        cpu3 = cpu_seconds(pid)
        check_equal(self.state, restored, "ckptd restore")
        del restored
        self.step += 1
        return {
            "save": t1 - t0,
            "local": t2 - t0,
            "restore": t4 - t3,
            "restore_return": t_ret - t3,
            "daemon_cpu_save": cpu1 - cpu0,
            "daemon_cpu_restore": cpu3 - cpu2,
        }

    def floors(self, pool: ThreadPoolExecutor) -> dict[str, float]:
        """The three floors on this state's arrays."""
        settle()
        f0 = time.perf_counter()
        memcpy2(self.arrays, self.buf, self.offsets, pool)
        f1 = time.perf_counter()
        overwrite_direct(self.floor_file, self.buf, self.size)
        f2 = time.perf_counter()
        drop_caches(self.floor_file)
        settle()
        f3 = time.perf_counter()
        read_direct_crc(self.floor_file, self.buf, self.size)
        f4 = time.perf_counter()
        return {"floor_memcpy": f1 - f0, "floor_memcpy_write": f2 - f0, "floor_read_crc": f4 - f3}

    def peer(self, group: str, rep: int) -> dict[str, float]:
        """The DCP or Orbax arm: save then restore of the same step."""
        arm = self.dcp if group == "dcp" else self.orbax
        assert arm is not None
        return arm.save(rep) | arm.restore(rep)

    def close(self) -> None:
        """Close the client and the Orbax checkpointer."""
        self.client.close()
        if self.orbax is not None:
            self.orbax.close()


def run_all(args: argparse.Namespace, run: Path) -> dict[str, Any]:
    """Build the states, then ``--reps`` interleaved repetitions after one warm-up."""
    groups = [g for g in args.arms.split(",") if g]
    if "dcp" in groups:
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            print(f"DCP arm skipped: torch cannot be imported ({exc}); `make bench-deps`")
            groups.remove("dcp")
    load = [os.getloadavg()]
    t0 = time.perf_counter()
    tstate, shape = transformer_state(int(args.gib * 2**30), param_dtype(args.param_dtype), 0)
    total = sum(a.nbytes for a in leaves(tstate))
    states = {"transformer": tstate, "8arrays": eight_array_state(total, 1)}
    states = {k: v for k, v in states.items() if k in args.states.split(",")}
    print(
        f"states ready in {time.perf_counter() - t0:.1f} s: transformer "
        f"{len(list(leaves(tstate)))} arrays ({shape}, params {args.param_dtype}), "
        f"{total / 2**30:.3f} GiB each; arms {groups}",
        flush=True,
    )
    daemon = Daemon(run / "root", extra_args=["--retention-local", "KeepLatest(2)"])
    daemon.start()
    pool = ThreadPoolExecutor(2)
    runs: dict[str, StateRun] = {}
    samples: dict[str, dict[str, list[float]]] = {k: {} for k in states}
    warmup: dict[str, dict[str, float]] = {}
    try:
        for name, st in states.items():
            runs[name] = StateRun(name, st, run, daemon, groups)
        for rep in range(args.reps + 1):  # rep 0 warms leases, spare files, imports
            order = list(runs) if rep % 2 else list(reversed(runs))
            for name in order:
                sr, row = runs[name], {}
                k = rep % len(groups)
                for group in groups[k:] + groups[:k]:
                    if group == "ckptd":
                        row |= sr.ckptd()
                    elif group == "floors":
                        row |= sr.floors(pool)
                    else:
                        row |= sr.peer(group, rep)
                if rep == 0:
                    warmup[name] = row
                else:
                    for key, v in row.items():
                        samples[name].setdefault(key, []).append(v)
                print(
                    f"rep {rep}{' (warm-up)' if rep == 0 else ''} {name}: "
                    + ", ".join(f"{key} {v:.3f}" for key, v in row.items()),
                    flush=True,
                )
    finally:
        for sr in runs.values():
            sr.close()
        pool.shutdown()
        daemon.stop()
    counts = {name: len(sr.arrays) for name, sr in runs.items()}
    return {
        "samples": samples,
        "warmup": warmup,
        "counts": counts,
        "nbytes": total,
        "shape": shape,
        "groups": groups,
        "daemon_args": daemon.args,
        "loadavg_start_end": [*load, os.getloadavg()],
    }


def med(s: dict[str, list[float]], key: str) -> float | None:
    """The median of ``s[key]`` (None if not measured); CPU seconds: the mean."""
    if key not in s:
        return None
    return statistics.fmean(s[key]) if key.startswith("daemon_cpu") else statistics.median(s[key])


def report(res: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Print the tables; returns the JSON document."""
    samples, counts = res["samples"], res["counts"]
    names = list(samples)
    arms = sorted({k for s in samples.values() for k in s}, key=_arm_order)

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f}"

    print_table(
        ["arm (median ms)", *(f"{n} ({counts[n]} arrays)" for n in names)],
        [[a, *(ms(med(samples[n], a)) for n in names)] for a in arms],
        f"{res['nbytes'] / 2**30:.3f} GiB state, medians of {args.reps} (CPU: mean)",
    )
    ratios: dict[str, dict[str, Any]] = {}
    rows = []
    for label, arm, floor in ROWS:
        # Floors depend on bytes, not on arrays: the pooled median of both states'
        # samples is the one floor both are held to (and less noisy than either).
        pooled = [v for n in names for v in samples[n].get(floor, [])]
        fp = statistics.median(pooled) if pooled else None
        for n in names:
            c, f = med(samples[n], arm), med(samples[n], floor)
            if c is None or f is None or fp is None:
                continue
            r, rp = c / f, c / fp
            ratios[f"{n}:{arm}/{floor}"] = {
                "ratio": r,
                "ratio_pooled_floor": rp,
                "ckptd": c,
                "floor_this_state": f,
                "floor_pooled": fp,
                "floor_is": FLOOR_NAMES[floor],
                # ckptd / floor within each repetition (run minutes apart at most), then
                # the median: less exposed to load that comes and goes between arms.
                "median_of_paired_ratios": statistics.median(
                    x / y for x, y in zip(samples[n][arm], samples[n][floor], strict=True)
                ),
            }
            goal = "(reference)"
            if n == "transformer":
                goal = f"<= {GOALS[arm]}: " + ("met" if rp <= GOALS[arm] else "NOT met")
            paired = ratios[f"{n}:{arm}/{floor}"]["median_of_paired_ratios"]
            rows.append(
                [label, n, ms(c), ms(f), f"{r:.2f}x", f"{paired:.2f}x", ms(fp), f"{rp:.2f}x", goal]
            )
    print_table(
        [
            "",
            "state",
            "ckptd",
            "floor",
            "ratio",
            "paired",
            "pooled floor",
            "ratio",
            "goal (pooled)",
        ],
        rows,
        "ckptd / floor (median ms; floor: this state's; pooled: both states' samples)",
    )
    for _label, arm, floor in ROWS:
        print(f"  {arm} floor: {FLOOR_NAMES[floor]}")
    print("  paired: the median of the per-repetition ratios ckptd / this state's floor")
    peer_rows = []
    for n in names:
        s = samples[n]
        for label, arm, peer in (
            ("save() returns vs DCP async_save return", "save", "dcp_async_return"),
            ("save() returns vs Orbax save return", "save", "orbax_return"),
            ("LOCAL vs DCP save (fsynced)", "local", "dcp_save"),
            ("LOCAL vs Orbax finished + fsync", "local", "orbax_fsynced"),
            ("restore vs DCP load (into touched tensors)", "restore", "dcp_restore"),
            ("restore vs Orbax restore", "restore", "orbax_restore"),
        ):
            c, p = med(s, arm), med(s, peer)
            if c is not None and p is not None:
                ratios[f"{n}:{arm}/{peer}"] = {"ratio": c / p, "ckptd": c, "peer": p}
                peer_rows.append([label, n, ms(c), ms(p), f"{c / p:.2f}x"])
    if peer_rows:
        print_table(["", "state", "ckptd ms", "peer ms", "ratio"], peer_rows, "ckptd / peers")
    extra = counts.get("transformer", 0) - counts.get("8arrays", 0)
    per_tensor = {}
    if extra > 0:
        for a in ("save", "local", "restore", "daemon_cpu_save", "daemon_cpu_restore"):
            c1, c0 = med(samples["transformer"], a), med(samples["8arrays"], a)
            if c1 is not None and c0 is not None:
                per_tensor[a] = (c1 - c0) / extra * 1e6
        print("per extra array (us): " + ", ".join(f"{k} {v:.1f}" for k, v in per_tensor.items()))
    return {
        "benchmark": "transformer",
        "args": vars(args) | {"dir": str(args.dir)},
        "state_bytes": res["nbytes"],
        "transformer_shape": res["shape"],
        "array_counts": counts,
        "arms_run": res["groups"],
        "daemon_args": res["daemon_args"],
        "versions": _versions(res["groups"]),
        "measurements": {n: {a: summarize(v) for a, v in s.items()} for n, s in samples.items()},
        "warmup": res["warmup"],
        "loadavg_start_end": res["loadavg_start_end"],
        "ratios": ratios,
        "per_extra_array_us": per_tensor,
        "goals_transformer": GOALS,
    }


def _arm_order(arm: str) -> tuple[int, str]:
    prefixes = ("save", "local", "restore", "daemon", "floor", "dcp", "orbax")
    return next((i for i, p in enumerate(prefixes) if arm.startswith(p)), 9), arm


def _versions(groups: list[str]) -> dict[str, str]:
    out = {"numpy": np.__version__}
    if "dcp" in groups:
        import torch

        out["torch"] = torch.__version__
    if "orbax" in groups:
        import orbax.checkpoint

        out["orbax-checkpoint"] = orbax.checkpoint.__version__
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (default 3)")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--arms", default=",".join(GROUPS), help="subset of " + ",".join(GROUPS))
    p.add_argument("--states", default=",".join(STATES), help="subset of " + ",".join(STATES))
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch dir (same disk)")
    p.add_argument("--name", default="transformer", help="results: bench/results/NAME.json")
    args = p.parse_args(argv)
    if args.gib <= 0 or args.reps < 1:
        p.error("--gib and --reps must be positive")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.dir = args.dir.resolve()
    with run_directory(args.dir, "transformer") as run:
        doc = report(run_all(args, run), args)
    print(f"load average at start / end: {doc['loadavg_start_end']}")
    print(f"results: {write_results(args.name, doc, work_dir=args.dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
