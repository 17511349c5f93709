"""save() against the memcpy of the same arrays: each state's own floor, and where the rest goes.

The transformer-shaped training state of ``bench_transformer.py`` (``--gib``,
default 1: ~1,500 arrays, parameters plus Adam's two moments) saved as numpy
arrays and as CPU torch tensors (``torch.from_numpy`` views of the same arrays),
and (``--states``, not by default) the same bytes in 8 float32 arrays. On each
state, interleaved repetitions of:

- floor: a 2-thread memcpy of exactly this state's arrays into a touched buffer
  (split in two halves by bytes; ``bench_tensors.memcpy2``);
- ``save()``: the trainer's blocking time, until it returns (the state is saved
  ``wait("local")`` before the next arm, so no write of the daemon overlaps an arm),
  split into the client's phases: the lease (AcquireLease), the copy into it, the
  handoff's wait past the copy (CommitShards goes out as the copy starts and is
  answered once the daemon journaled it; what is left of it once the copy is done,
  the word written), and the rest (flattening the tree, the plan, the request).

The goal: ``save()`` <= 1.2x its own state's floor (the median of the per-repetition
ratios). A table on stdout and ``bench/results/save_floor.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from bench_tensors import memcpy2
from common import (
    DEFAULT_WORK_DIR,
    Daemon,
    print_table,
    run_directory,
    settle,
    summarize,
    write_results,
)
from floors import packed_offsets, packed_size, touched_buffer
from transformer_arms import Tree, eight_array_state, leaves, transformer_state, tree_map

from ckptd.client import Client
from ckptd.client.handoff import Copying

STATES = ("transformer-numpy", "transformer-torch", "8arrays")
DEFAULT_STATES = "transformer-numpy,transformer-torch"
"""Two jobs on one daemon, as bench_transformer: each job's last step kept in shared
memory (the memory tier), its next lease and a spare fit the 6 GiB staging budget.
A third job of 1 GiB does not, and then every save makes its segment afresh: that
is a measure of the budget, not of save()."""
GOAL = 1.2
PHASES = ("acquire", "copy", "commit")


def timed_method(obj: Any, name: str, sink: dict[str, float], label: str) -> None:
    """Replace ``obj.name`` by a wrapper adding its seconds to ``sink[label]``."""
    orig: Callable[..., Any] = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            sink[label] = sink.get(label, 0.0) + time.perf_counter() - t0

    setattr(obj, name, wrapper)


class StateRun:
    """One state: its client (phases timed), its arrays and its floor's buffer."""

    def __init__(
        self, name: str, tree: Tree, arrays: list[np.ndarray], daemon: Daemon, buf: Any
    ) -> None:
        self.name, self.tree, self.arrays, self.buf = name, tree, arrays, buf
        self.offsets = packed_offsets(arrays)
        self.client = Client(f"floor-{name}", socket=daemon.socket)
        self.phases: dict[str, float] = {}
        # The client's own steps, timed where it calls them (private names: a bench
        # looks inside; a wrapper costs a microsecond against a save's ~100 ms).
        saver = self.client._saver
        timed_method(saver._handoff, "acquire", self.phases, "acquire")
        timed_method(saver, "copy_arrays", self.phases, "copy")
        # The commit runs beside the copy: what the trainer waits for is what is left
        # of it once the copy is done (Copying.done: the word, then the answer).
        timed_method(Copying, "done", self.phases, "commit")
        self.step = 0

    def floor(self, pool: ThreadPoolExecutor) -> float:
        """The 2-thread memcpy of this state's arrays."""
        settle()
        t0 = time.perf_counter()
        memcpy2(self.arrays, self.buf, self.offsets, pool)
        return time.perf_counter() - t0

    def save(self) -> dict[str, float]:
        """``save()``'s blocking time and its phases; then LOCAL, untimed."""
        settle()
        self.phases.clear()
        t0 = time.perf_counter()
        handle = self.client.save(self.step, self.tree)
        took = time.perf_counter() - t0
        row = {"save": took, **{p: self.phases.get(p, 0.0) for p in PHASES}}
        row["rest"] = took - sum(row[p] for p in PHASES)
        handle.wait("local")
        self.step += 1
        return row


def build_states(args: argparse.Namespace) -> dict[str, tuple[Tree, list[np.ndarray]]]:
    """The states asked for: ``{name: (tree, its arrays as numpy)}``."""
    want = [s for s in args.states.split(",") if s]
    numpy_state, shape = transformer_state(int(args.gib * 2**30), np.dtype(np.float32), 0)
    arrays = list(leaves(numpy_state))
    out: dict[str, tuple[Tree, list[np.ndarray]]] = {}
    if "transformer-numpy" in want:
        out["transformer-numpy"] = (numpy_state, arrays)
    if "transformer-torch" in want:
        try:
            import torch
        except ImportError as exc:
            print(f"transformer-torch skipped: torch cannot be imported ({exc}); make bench-deps")
        else:
            out["transformer-torch"] = (tree_map(torch.from_numpy, numpy_state), arrays)
    if "8arrays" in want:
        eight = eight_array_state(sum(a.nbytes for a in arrays), 1)
        out["8arrays"] = (eight, list(eight.values()))
    print(
        f"transformer: {len(arrays)} arrays ({shape}), "
        f"{sum(a.nbytes for a in arrays) / 2**30:.3f} GiB; states {list(out)}",
        flush=True,
    )
    return out


def run_all(args: argparse.Namespace, run: Path) -> dict[str, Any]:
    """One warm-up, then ``--reps`` repetitions, states and arms in rotating order."""
    states = build_states(args)
    load = [os.getloadavg()]
    daemon = Daemon(
        run / "root",
        staging_budget=args.staging_budget,
        extra_args=["--retention-local", "KeepLatest(2)"],
    )
    daemon.start()
    pool = ThreadPoolExecutor(2)
    runs: dict[str, StateRun] = {}
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in states}
    warmup: dict[str, dict[str, float]] = {}
    try:
        # One touched destination for every state's floor (each in its own layout).
        buf = touched_buffer(max(packed_size(a) for _, a in states.values()))
        for name, (tree, arrays) in states.items():
            runs[name] = StateRun(name, tree, arrays, daemon, buf)
        for rep in range(args.reps + 1):  # rep 0 warms leases, spare segments, imports
            names = list(runs)
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                sr = runs[name]
                if rep % 2:
                    row = {"floor": sr.floor(pool)} | sr.save()
                else:
                    row = sr.save()
                    row["floor"] = sr.floor(pool)
                if rep == 0:
                    warmup[name] = row
                else:
                    for key, v in row.items():
                        samples[name].setdefault(key, []).append(v)
                print(
                    f"rep {rep}{' (warm-up)' if rep == 0 else ''} {name}: save/floor "
                    f"{row['save'] / row['floor']:.2f}; "
                    + ", ".join(f"{key} {v * 1e3:.1f}" for key, v in row.items())
                    + " ms",
                    flush=True,
                )
    finally:
        for sr in runs.values():
            sr.client.close()
        pool.shutdown()
        daemon.stop()
    return {
        "samples": samples,
        "warmup": warmup,
        "counts": {n: len(a) for n, (_, a) in states.items()},
        "nbytes": {n: sum(x.nbytes for x in a) for n, (_, a) in states.items()},
        "daemon_args": daemon.args,
        "loadavg_start_end": [*load, os.getloadavg()],
    }


def report(res: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Print the table; returns the JSON document."""
    samples, counts = res["samples"], res["counts"]
    rows, ratios = [], {}
    for n, s in samples.items():
        med = {k: statistics.median(v) for k, v in s.items()}
        paired = statistics.median(a / b for a, b in zip(s["save"], s["floor"], strict=True))
        ratios[n] = {
            "median_of_paired_ratios": paired,
            "ratio_of_medians": med["save"] / med["floor"],
            "save": med["save"],
            "floor": med["floor"],
            "phases": {p: med[p] for p in (*PHASES, "rest")},
            "goal": GOAL,
            "met": paired <= GOAL,
        }
        rows.append(
            [
                n,
                counts[n],
                *(f"{med[k] * 1e3:.1f}" for k in ("floor", "save", *PHASES, "rest")),
                f"{med['save'] / med['floor']:.2f}x",
                f"{paired:.2f}x",
                "met" if paired <= GOAL else "NOT met",
            ]
        )
    print_table(
        [
            "state",
            "arrays",
            "floor",
            "save()",
            "acquire",
            "copy",
            "commit",
            "rest",
            "ratio",
            "paired",
            f"<= {GOAL}x",
        ],
        rows,
        f"save() vs its own state's 2-thread memcpy (median ms of {args.reps}; "
        "paired: the median of per-repetition ratios)",
    )
    print("  rest: flattening the tree, the plan, the request, bookkeeping")
    return {
        "benchmark": "save_floor",
        "args": vars(args) | {"dir": str(args.dir)},
        "array_counts": counts,
        "state_bytes": res["nbytes"],
        "daemon_args": res["daemon_args"],
        "floor_is": "2-thread memcpy of the state's arrays into a touched buffer",
        "measurements": {n: {k: summarize(v) for k, v in s.items()} for n, s in samples.items()},
        "warmup": res["warmup"],
        "loadavg_start_end": res["loadavg_start_end"],
        "ratios": ratios,
        "goal": GOAL,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    p.add_argument("--reps", type=int, default=9, help="timed repetitions (default 9)")
    p.add_argument("--states", default=DEFAULT_STATES, help="subset of " + ",".join(STATES))
    p.add_argument("--staging-budget", default="6GiB", help="the daemon's (default 6GiB)")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch dir (same disk)")
    p.add_argument("--name", default="save_floor", help="results: bench/results/NAME.json")
    args = p.parse_args(argv)
    if args.gib <= 0 or args.reps < 1:
        p.error("--gib and --reps must be positive")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.dir = args.dir.resolve()
    with run_directory(args.dir, "save_floor") as run:
        doc = report(run_all(args, run), args)
    print(f"load average at start / end: {doc['loadavg_start_end']}")
    print(f"results: {write_results(args.name, doc, work_dir=args.dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
