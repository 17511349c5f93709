"""Goodput per arm per cell from the simulator (bench/goodput/sim.py), with the oracle.

Arms, each on the same failure traces and step-time draws:

- ``goodput``: ckptd ``Goodput()``, the default (MTBF learned from the record);
- ``goodput-mtbf``: ``Goodput(mtbf_seconds=MTBF)``, told the true MTBF;
- ``continuous``: ckptd ``Continuous()``;
- ``young-daly``: ``FixedInterval(k)``, ``k`` steps of Young/Daly's ``sqrt(2 C M)``
  from the true MTBF and the mean cost;
- ``oracle``: ``FixedInterval(k)`` at the ``k`` with the best mean goodput over the
  cell's traces, found by search (a log grid around the model's optimum, then
  golden-section between the grid's neighbours of the best).

    .venv/bin/python bench/goodput/sim_run.py --mtbf 600,3600,21600,86400 --horizon-hours 72

A cell's goodput is the mean over its traces with a 95% confidence interval
(normal, 1.96 standard errors).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim import COSTS_DEFAULT, Costs, Failure, failure_trace, simulate

from ckptd.client.goodput import Goodput
from ckptd.client.policies import Continuous, FixedInterval, SavePolicy

ARMS = ("goodput", "goodput-mtbf", "continuous", "young-daly", "oracle")
_PHI = (math.sqrt(5) - 1) / 2


def young_daly_steps(costs: Costs, mtbf: float) -> int:
    """Young/Daly's interval ``sqrt(2 C M)`` in whole steps (at least 1)."""
    return max(round(math.sqrt(2 * costs.save_cost * mtbf) / costs.step.mean), 1)


@dataclass(frozen=True)
class Arm:
    """A policy factory that crosses process boundaries (a lambda does not)."""

    name: str
    mtbf: float = 0.0
    steps: int = 1

    def __call__(self) -> SavePolicy:
        if self.name == "goodput":
            return Goodput()
        if self.name == "goodput-mtbf":
            return Goodput(mtbf_seconds=self.mtbf)
        if self.name == "continuous":
            return Continuous()
        return FixedInterval(self.steps)


def _one(job: tuple[Callable[[], SavePolicy], Costs, list[Failure], float, int]) -> float:
    make, costs, failures, horizon, seed = job
    return simulate(make, costs, failures, horizon, seed)["goodput"]


_POOL: list[Executor] = []
"""The worker pool main() opens (none: run in this process, as the tests do)."""


def run_traces(
    make: Callable[[], SavePolicy], costs: Costs, traces: list[Any], horizon: float
) -> list[float]:
    """Goodput of one arm on each ``(seed, failures)`` trace."""
    jobs = [(make, costs, f, horizon, seed) for seed, f in traces]
    if _POOL:
        return list(_POOL[0].map(_one, jobs))
    return [_one(job) for job in jobs]


def oracle(
    costs: Costs, traces: list[Any], horizon: float, mtbf: float
) -> tuple[int, list[float], dict[int, float]]:
    """The fixed interval (steps) with the best mean goodput on ``traces``: its
    interval, its per-trace goodputs, and every interval tried with its mean."""
    seen: dict[int, list[float]] = {}

    def mean(k: int) -> float:
        k = max(k, 1)
        if k not in seen:
            seen[k] = run_traces(Arm("fixed", steps=k), costs, traces, horizon)
        return statistics.fmean(seen[k])

    k0 = young_daly_steps(costs, mtbf)
    grid = sorted({max(round(k0 * m), 1) for m in (0.25, 0.4, 0.6, 0.8, 1.0, 1.25, 1.6, 2.5, 4)})
    best = max(grid, key=mean)
    at = grid.index(best)
    lo, hi = grid[max(at - 1, 0)], grid[min(at + 1, len(grid) - 1)]
    # golden-section on the bracket (goodput is unimodal in k, near enough)
    a, b = float(lo), float(hi)
    while b - a > 2:
        c, d = b - _PHI * (b - a), a + _PHI * (b - a)
        if mean(round(c)) >= mean(round(d)):
            b = d
        else:
            a = c
    for k in range(max(int(a) - 1, 1), int(b) + 2):
        mean(k)
    best = max(seen, key=lambda k: statistics.fmean(seen[k]))
    return best, seen[best], {k: statistics.fmean(v) for k, v in sorted(seen.items())}


def summary(values: list[float]) -> dict[str, float]:
    """Mean and 95% confidence half-width."""
    m = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return {"mean": m, "ci95": half, "min": min(values), "max": max(values)}


def cell(
    costs: Costs, mtbf: float, horizon: float, n: int, shape: float, node_fraction: float
) -> dict[str, Any]:
    """Every arm on ``n`` traces of one cell."""
    traces = [(seed, failure_trace(mtbf, horizon, seed, shape, node_fraction)) for seed in range(n)]
    k_yd = young_daly_steps(costs, mtbf)
    makes = {
        "goodput": Arm("goodput"),
        "goodput-mtbf": Arm("goodput-mtbf", mtbf),
        "continuous": Arm("continuous"),
        "young-daly": Arm("fixed", steps=k_yd),
    }
    per = {arm: run_traces(make, costs, traces, horizon) for arm, make in makes.items()}
    k_or, per["oracle"], tried = oracle(costs, traces, horizon, mtbf)
    return {
        "mtbf_seconds": mtbf,
        "young_daly_steps": k_yd,
        "oracle_steps": k_or,
        "oracle_tried": tried,
        "failures_mean": statistics.fmean(len(f) for _, f in traces),
        "arms": {
            arm: {
                **summary(v),
                # paired on the same traces: far tighter than the arms' own intervals
                "minus_oracle": summary([a - b for a, b in zip(v, per["oracle"], strict=True)]),
                "per_trace": v,
            }
            for arm, v in per.items()
        },
    }


def table(cells: list[dict[str, Any]]) -> str:
    """The cells as a markdown table: goodput mean +- 95% CI per arm."""
    head = "| MTBF s | failures | " + " | ".join(ARMS) + " | k YD / oracle |"
    rows = [head, "|" + "---|" * (len(ARMS) + 3)]
    for c in cells:
        vals = [f"{c['arms'][a]['mean']:.4f} ± {c['arms'][a]['ci95']:.4f}" for a in ARMS]
        ks = f"{c['young_daly_steps']} / {c['oracle_steps']}"
        rows.append(
            f"| {c['mtbf_seconds']:g} | {c['failures_mean']:.1f} | {' | '.join(vals)} | {ks} |"
        )
    rows += ["", "paired, arm - oracle on the same traces (mean ± 95% CI):", head, rows[1]]
    for c in cells:
        diff = [c["arms"][a]["minus_oracle"] for a in ARMS]
        vals = [f"{d['mean']:+.4f} ± {d['ci95']:.4f}" for d in diff]
        ks = f"{c['young_daly_steps']} / {c['oracle_steps']}"
        head = f"| {c['mtbf_seconds']:g} | {c['failures_mean']:.1f}"
        rows.append(f"{head} | {' | '.join(vals)} | {ks} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """The CLI: cells of MTBF x one horizon, a table on stdout, JSON in bench/results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mtbf", default="600,3600,21600,86400", help="seconds, comma-separated")
    ap.add_argument("--horizon-hours", type=float, default=72.0)
    ap.add_argument("--traces", type=int, default=100)
    ap.add_argument("--weibull-shape", type=float, default=1.0, help="1: exponential")
    ap.add_argument("--node-fraction", type=float, default=0.0)
    ap.add_argument("--costs", type=Path, default=COSTS_DEFAULT)
    ap.add_argument("--quick", action="store_true", help="10 traces, 24 h")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    ap.add_argument("--name", default="goodput-sim", help="bench/results/NAME.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.traces, args.horizon_hours = min(args.traces, 10), min(args.horizon_hours, 24.0)
    costs = Costs.load(args.costs)
    horizon = args.horizon_hours * 3600
    started = time.monotonic()
    cells = []
    with ProcessPoolExecutor(args.jobs) as pool:
        _POOL.append(pool)
        for m in (float(x) for x in args.mtbf.split(",")):
            shape, nodes = args.weibull_shape, args.node_fraction
            cells.append(cell(costs, m, horizon, args.traces, shape, nodes))
            print(f"MTBF {m:g} s done at {time.monotonic() - started:.0f} s", file=sys.stderr)
        _POOL.clear()
    print(table(cells))
    from common import write_results

    path = write_results(
        args.name,
        {
            "horizon_hours": args.horizon_hours,
            "traces": args.traces,
            "weibull_shape": args.weibull_shape,
            "node_fraction": args.node_fraction,
            "costs_file": str(args.costs),
            "seconds": time.monotonic() - started,
            "cells": cells,
        },
    )
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
