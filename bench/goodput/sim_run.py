"""Goodput per arm per cell from the simulator (bench/goodput/sim.py), with the oracle.

Arms, each on the same failure traces and step-time draws, each with its own
costs (its section of the costs file: ckptd, orbax, dcp, dlrover; an arm whose
section the file lacks is left out):

- ``goodput``: ckptd ``Goodput()``, the default (MTBF learned from the record);
- ``goodput-mtbf``: ``Goodput(mtbf_seconds=MTBF)``, told the true MTBF;
- ``continuous``: ckptd ``Continuous()``;
- ``young-daly``: ``FixedInterval(k)``, ``k`` steps of Young/Daly's ``sqrt(2 C M)``
  from the true MTBF and ckptd's mean cost;
- ``oracle``: ckptd's ``FixedInterval(k)`` at the ``k`` with the best mean goodput
  over the cell's traces, found by search (a log grid around the model's
  optimum, then golden-section between the grid's neighbours of the best);
- ``orbax-continuous``: Orbax's ``ContinuousCheckpointingPolicy`` (save when no
  save is in progress: the previous one committed), with Orbax's costs;
- ``orbax-yd``, ``dcp-yd``: every ``k`` steps at Young/Daly's ``k`` from their own
  mean cost and the true MTBF (tuned peers); a save waits for the previous one
  to commit, as their ``save()`` does;
- ``dlrover``: DLRover's flash checkpoint, a memory snapshot every step and every
  ``N`` steps to storage, ``N`` at Young/Daly from the node-loss MTBF
  (MTBF / node fraction) and its save cost.

    .venv/bin/python bench/goodput/sim_run.py --mtbf 600,3600,21600,86400 --horizon-hours 72

A cell's goodput is the mean over its traces with a 95% confidence interval
(normal, 1.96 standard errors); its overhead the fraction of the trainer's
running time (restarts excluded) spent in save blocking and the slowdown after
saves. ``--plot`` also draws bench/results/NAME.png (bench/goodput/sim_plot.py).
"""

from __future__ import annotations

import argparse
import itertools
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

from sim import COSTS_DEFAULT, Costs, Failure, FlashCheckpoint, cost_arms, failure_trace, simulate
from sim_inputs import mean_mtbf, phased_trace
from sim_table import floats as _floats
from sim_table import phases as _phases
from sim_table import table

from ckptd.client.goodput import Goodput
from ckptd.client.policies import Continuous, FixedInterval, SavePolicy

ARMS = (
    "goodput",
    "goodput-mtbf",
    "continuous",
    "young-daly",
    "oracle",
    "orbax-continuous",
    "orbax-yd",
    "dcp-yd",
    "dlrover",
)
COSTS_OF = {"orbax-continuous": "orbax", "orbax-yd": "orbax", "dcp-yd": "dcp", "dlrover": "dlrover"}
"""The costs-file section of each peer arm (every other arm: ``ckptd``)."""
_SERIAL = frozenset({"orbax-continuous", "orbax-yd", "dcp-yd"})
"""Arms whose ``save()`` waits for the previous save to commit."""
_PHI = (math.sqrt(5) - 1) / 2
NAMES_SAMPLED = 16
"""Other node names whose claims the daemon samples (daemon/remote/node_fleet.py)."""


def young_daly_steps(costs: Costs, mtbf: float) -> int:
    """Young/Daly's interval ``sqrt(2 C M)`` in whole steps (at least 1)."""
    return max(round(math.sqrt(2 * costs.save_cost * mtbf) / costs.step.mean), 1)


@dataclass(frozen=True)
class Arm:
    """A policy factory that crosses process boundaries (a lambda does not)."""

    name: str
    mtbf: float = 0.0
    steps: int = 1
    durable_steps: int = 1
    memory_steps: int = 1

    def __call__(self) -> SavePolicy:
        if self.name == "goodput":
            return Goodput()
        if self.name == "goodput-mtbf":
            return Goodput(mtbf_seconds=self.mtbf)
        if self.name == "continuous":
            return Continuous()
        if self.name == "orbax-continuous":
            # with Orbax's costs "local" is its commit (finalize): no save in progress
            return Continuous(stage="local")
        if self.name == "dlrover":
            return FlashCheckpoint(self.durable_steps, self.memory_steps)
        return FixedInterval(self.steps)

    @property
    def costs(self) -> str:
        """The section of the costs file this arm runs with."""
        return COSTS_OF.get(self.name, "ckptd")

    @property
    def serial(self) -> bool:
        """Whether a save waits for the previous one to commit."""
        return self.name in _SERIAL


def _one(job: tuple[Callable[[], SavePolicy], Costs, list[Failure], float, int, bool, Any]) -> Any:
    make, costs, failures, horizon, seed, serial, fleet, nodes = job
    run = simulate(
        make, costs, failures, horizon, seed, serial=serial, fleet=fleet, node_fleet=nodes
    )
    return {"goodput": run["goodput"], "overhead": run["overhead"]}


_POOL: list[Executor] = []
"""The worker pool main() opens (none: run in this process, as the tests do)."""


def run_arm(
    make: Callable[[], SavePolicy],
    costs: Costs,
    traces: list[Any],
    horizon: float,
    serial: bool = False,
) -> list[dict[str, float]]:
    """Goodput and overhead of one arm on each ``(seed, failures[, fleet[, node
    names' record]])`` trace."""
    jobs = [
        (make, costs, t[1], horizon, t[0], serial, t[2] if len(t) > 2 else (0.0, 0),
         t[3] if len(t) > 3 else None)
        for t in traces
    ]  # fmt: skip
    if _POOL:
        return list(_POOL[0].map(_one, jobs))
    return [_one(job) for job in jobs]


def oracle_runs(
    costs: Costs, traces: list[Any], horizon: float, mtbf: float
) -> tuple[int, list[dict[str, float]], dict[int, float]]:
    """The fixed interval (steps) with the best mean goodput on ``traces``: its
    interval, its runs (goodput, overhead per trace), and every interval tried with
    its mean."""
    seen: dict[int, list[float]] = {}
    runs: dict[int, list[dict[str, float]]] = {}

    def mean(k: int) -> float:
        k = max(k, 1)
        if k not in seen:
            runs[k] = run_arm(Arm("fixed", steps=k), costs, traces, horizon)
            seen[k] = [r["goodput"] for r in runs[k]]
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
    return best, runs[best], {k: statistics.fmean(v) for k, v in sorted(seen.items())}


def summary(values: list[float]) -> dict[str, float]:
    """Mean and 95% confidence half-width."""
    m = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return {"mean": m, "ci95": half, "min": min(values), "max": max(values)}


def load_costs(path: Path) -> dict[str, Costs]:
    """Every arm's costs in a costs file, by section (``ckptd``, ``orbax``, ...)."""
    return {arm: Costs.load(path, arm) for arm in cost_arms(path)}


def peer_arms(
    costs: dict[str, Costs], mtbf: float, horizon: float, node_fraction: float
) -> list[Arm]:
    """The peer arms the costs file has costs for, tuned to the true MTBF."""
    arms: list[Arm] = []
    if "orbax" in costs:
        arms.append(Arm("orbax-continuous"))
        arms.append(Arm("orbax-yd", steps=young_daly_steps(costs["orbax"], mtbf)))
    if "dcp" in costs:
        arms.append(Arm("dcp-yd", steps=young_daly_steps(costs["dcp"], mtbf)))
    if "dlrover" in costs:
        dl = costs["dlrover"]
        # tuned as its users would: memory at Young/Daly for every failure (all but
        # node losses restore from it), storage at Young/Daly for the node losses alone
        m = young_daly_steps(dl, mtbf)
        if node_fraction > 0:
            n = young_daly_steps(dl, mtbf / node_fraction)
        else:  # no node loss to survive: storage once per horizon
            n = int(horizon / dl.step.mean) + 1
        n = max(round(n / m), 1) * m
        arms.append(Arm("dlrover", durable_steps=n, memory_steps=m))
    return arms


def cell(
    costs: dict[str, Costs] | Costs,
    mtbf: float,
    horizon: float,
    n: int,
    shape: float,
    node_fraction: float,
    fleet_days: float = 0.0,
    phases: list[tuple[float, float]] | None = None,
    only: frozenset[str] | None = None,
) -> dict[str, Any]:
    """Every arm (those ``costs`` has a section for) on ``n`` traces of one cell.
    ``fleet_days``: the node's record of earlier jobs, that many days of active time
    with the restarts a trace of the same MTBF and shape has in them (``Goodput()``'s
    prior; 0: a node with no record); with node losses, the bucket's record of 17
    node names claimed that long, their replacements at the cell's node-loss rate
    (the learned node MTBF's). ``phases``: ``(mtbf, seconds)`` one after another
    instead (a rate that changes; ``mtbf`` their mean, ``horizon`` their sum).
    ``only``: the arms to run (``goodput`` and the oracle always run; None: all)."""
    if isinstance(costs, Costs):
        costs = {"ckptd": costs}
    ck = costs["ckptd"]
    earlier = fleet_days * 86400

    def names(seed: int) -> tuple[float, int] | None:
        # the bucket's record of node names: this node's and 16 others', each claimed
        # for as long as the node's record of earlier jobs, replaced at the cell's rate
        if not earlier or not node_fraction:
            return None
        seconds = (1 + NAMES_SAMPLED) * earlier
        return (seconds, len(failure_trace(mtbf / node_fraction, seconds, seed + 2_000_003)))

    def trace(seed: int) -> list[Failure]:
        if phases:
            return phased_trace(phases, seed, shape, node_fraction)
        return failure_trace(mtbf, horizon, seed, shape, node_fraction)

    def fleet(seed: int) -> tuple[float, int]:
        if not earlier:
            return (0.0, 0)
        return (earlier, len(failure_trace(mtbf, earlier, seed + 1_000_003, shape, 0.0)))

    traces = [(seed, trace(seed), fleet(seed), names(seed)) for seed in range(n)]
    k_yd = young_daly_steps(ck, mtbf)
    arms = [
        Arm("goodput"),
        Arm("goodput-mtbf", mtbf),
        Arm("continuous"),
        Arm("young-daly", steps=k_yd),
        *peer_arms(costs, mtbf, horizon, node_fraction),
    ]
    arms = [a for a in arms if only is None or a.name in only or a.name == "goodput"]
    # an arm measured on its own (e.g. Orbax at the continuous policy's pace, where
    # its save blocks less) has a section of its name; else its framework's
    section = {a.name: a.name if a.name in costs else a.costs for a in arms}
    runs = {a.name: run_arm(a, costs[section[a.name]], traces, horizon, a.serial) for a in arms}
    k_or, runs["oracle"], tried = oracle_runs(ck, traces, horizon, mtbf)
    arms.append(Arm("oracle", steps=k_or))
    oracle_goodput = [r["goodput"] for r in runs["oracle"]]
    out: dict[str, Any] = {}
    for a in sorted(arms, key=lambda a: ARMS.index(a.name)):
        v = [r["goodput"] for r in runs[a.name]]
        out[a.name] = {
            **summary(v),
            # paired on the same traces: far tighter than the arms' own intervals
            "minus_oracle": summary([x - y for x, y in zip(v, oracle_goodput, strict=True)]),
            "overhead": summary([r["overhead"] for r in runs[a.name]]),
            "costs": section.get(a.name, a.costs),
            "steps": a.steps if a.name in ("young-daly", "oracle", "orbax-yd", "dcp-yd") else None,
            "durable_steps": a.durable_steps if a.name == "dlrover" else None,
            "memory_steps": a.memory_steps if a.name == "dlrover" else None,
            "per_trace": v,
        }
    mine = out["goodput"]["per_trace"]
    out["goodput"]["minus_peers"] = {
        name: summary([x - y for x, y in zip(mine, a["per_trace"], strict=True)])
        for name, a in out.items()
        if name in COSTS_OF
    }
    return {
        "mtbf_seconds": mtbf,
        "fleet_days": fleet_days,
        "weibull_shape": shape,
        "node_fraction": node_fraction,
        "phases": phases,
        "young_daly_steps": k_yd,
        "oracle_steps": k_or,
        "oracle_tried": tried,
        "failures_mean": statistics.fmean(len(t[1]) for t in traces),
        "arms": out,
    }


def main(argv: list[str] | None = None) -> int:
    """The CLI: cells of MTBF x failure mix over one horizon, a table on stdout, JSON
    (and with --plot a figure) in bench/results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mtbf", type=_floats, default="600,3600,21600,86400", help="seconds, a,b,c")
    ap.add_argument("--horizon-hours", type=float, default=72.0)
    ap.add_argument("--traces", type=int, default=100)
    ap.add_argument("--weibull-shape", type=_floats, default="1", help="1: exponential; a,b")
    ap.add_argument("--node-fraction", type=_floats, default="0", help="node losses; a,b")
    ap.add_argument("--costs", type=Path, default=COSTS_DEFAULT)
    ap.add_argument("--quick", action="store_true", help="10 traces, 24 h")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    ap.add_argument("--name", default="goodput-sim", help="bench/results/NAME.json")
    ap.add_argument("--plot", action="store_true", help="also bench/results/NAME.png")
    ap.add_argument(
        "--fleet-days",
        type=float,
        default=3.0,
        help="the node's record of earlier jobs, in days at the same MTBF (Goodput()'s "
        "prior; 0: a node with no record)",
    )
    ap.add_argument(
        "--phases",
        type=_phases,
        default=None,
        help="a rate that changes, instead of --mtbf and --horizon-hours: MTBF seconds x "
        "hours, one phase after another, e.g. 21600x24,600x24,21600x24",
    )
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=None,
                    help="arms to run (default: all; goodput and the oracle always)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.phases:
        args.mtbf = [mean_mtbf(args.phases)]
        args.horizon_hours = sum(s for _, s in args.phases) / 3600
    if args.quick:
        args.traces, args.horizon_hours = min(args.traces, 10), min(args.horizon_hours, 24.0)
    if any(not 0 <= f <= 1 for f in args.node_fraction) or min(args.weibull_shape) <= 0:
        ap.error("--node-fraction takes fractions in [0, 1], --weibull-shape shapes > 0")
    try:
        if "ckptd" not in cost_arms(args.costs):
            ap.error(f"{args.costs} has no costs for arm 'ckptd': its arms and the oracle need it")
        costs = load_costs(args.costs)
    except ValueError as e:
        ap.error(str(e))
    horizon = args.horizon_hours * 3600
    started = time.monotonic()
    cells = []
    with ProcessPoolExecutor(args.jobs) as pool:
        _POOL.append(pool)
        for shape, nodes, m in itertools.product(args.weibull_shape, args.node_fraction, args.mtbf):
            cells.append(
                cell(
                    costs,
                    m,
                    horizon,
                    args.traces,
                    shape,
                    nodes,
                    args.fleet_days,
                    args.phases,
                    frozenset(args.arms) if args.arms else None,
                )
            )
            t = time.monotonic() - started
            print(
                f"MTBF {m:g} s (shape {shape:g}, nodes {nodes:g}) done at {t:.0f} s",
                file=sys.stderr,
            )
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
            "fleet_days": args.fleet_days,
            "phases": args.phases,
            "costs_file": str(args.costs),
            "costs_arms": sorted(costs),
            "seconds": time.monotonic() - started,
            "cells": cells,
        },
    )
    print(f"wrote {path}", file=sys.stderr)
    if args.plot:
        from sim_plot import plot

        print(f"wrote {plot(path)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
