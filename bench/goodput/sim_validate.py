"""The simulator against the real harness: each real run of bench/goodput/run.py
predicted by bench/goodput/sim.py on the same kill times, with the costs measured
on the same trainer (bench/goodput/costs.py).

For every (arm, MTBF) cell of a run.py results file: the measured goodput over
its schedules (median, min-max) and the simulator's, each schedule simulated
``--repeats`` times (the costs are distributions) on that schedule's own kill
times (run.py's ``kill_times``), for that run's wall time. The prediction agrees
when its median falls within the measured min-max. The real runs start each arm
on a fresh daemon (no record of earlier jobs: no prior), as simulated here.

    .venv/bin/python bench/goodput/sim_validate.py bench/results/goodput-gpu.json \\
        --costs bench/goodput/costs-gpu-like.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from sim import Costs, Failure, simulate  # noqa: E402
from sim_inputs import kill_times  # noqa: E402

from ckptd.client.goodput import Goodput  # noqa: E402
from ckptd.client.policies import Continuous, FixedInterval, SavePolicy  # noqa: E402


def arm_policy(arm: str, mtbf: float, yd_steps: int) -> tuple[SavePolicy, str, bool]:
    """(policy, costs section, serial) of a run.py arm."""
    if arm == "ckptd-learned":
        return Goodput(), "ckptd", False
    if arm == "ckptd-goodput":
        return Goodput(mtbf_seconds=mtbf), "ckptd", False
    if arm == "ckptd-continuous":
        return Continuous(), "ckptd", False
    if arm == "orbax-continuous":
        return Continuous(stage="local"), "orbax", True
    if arm == "orbax-yd":
        return FixedInterval(yd_steps), "orbax", True
    raise ValueError(f"no simulated policy for arm {arm!r}")


def predict(
    arm: str, mtbf: float, seeds: list[int], seconds: float, costs: dict[str, Costs],
    yd_steps: int, repeats: int,
) -> list[float]:  # fmt: skip
    """The simulated goodput of each (schedule, repeat)."""
    out = []
    for seed in seeds:
        kills = [Failure(t) for t in kill_times(mtbf, seconds, seed)]
        _, section, serial = arm_policy(arm, mtbf, yd_steps)
        section = arm if arm in costs else section  # measured at the arm's own pace

        def make() -> SavePolicy:  # a new policy per life, as a restarted trainer builds
            return arm_policy(arm, mtbf, yd_steps)[0]

        for r in range(repeats):
            c = costs[section]
            # the first process starts as a restarted one does (less a restore of nothing)
            run = simulate(make, c, kills, seconds, seed * 1000 + r, serial=serial, start=c.restart)
            out.append(run["goodput"])
    return out


def validate(
    results: dict[str, Any], costs: dict[str, Costs], repeats: int
) -> list[dict[str, Any]]:
    """A row per (arm, MTBF): measured and predicted goodput, and whether they agree."""
    args = results["args"]
    seconds = float(args["seconds"])
    cal = results["calibration"]
    by_cell: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for c in results["cells"]:
        by_cell.setdefault((c["arm"], float(c["mtbf_s"])), []).append(c)
    rows = []
    for (arm, mtbf), runs in sorted(by_cell.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cost = cal.get("yd_cost_s") or 0.0
        k = max(1, round(math.sqrt(2 * cost * mtbf) / cal["base_step_s"]))
        seeds = [int(r["seed"]) for r in runs]
        measured = [float(r["goodput"]) for r in runs]
        pred = predict(arm, mtbf, seeds, seconds, costs, k, repeats)
        p50 = statistics.median(pred)
        rows.append({
            "arm": arm, "mtbf_s": mtbf, "schedules": len(runs),
            "measured_p50": statistics.median(measured),
            "measured_min": min(measured), "measured_max": max(measured),
            "predicted_p50": p50, "predicted_min": min(pred), "predicted_max": max(pred),
            "agrees": min(measured) <= p50 <= max(measured),
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    """The CLI: a table on stdout, JSON in bench/results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path, help="a bench/goodput/run.py results JSON")
    ap.add_argument("--costs", type=Path, required=True, help="the same trainer's costs file")
    ap.add_argument("--repeats", type=int, default=20, help="simulations per schedule")
    ap.add_argument("--name", default=None, help="bench/results/NAME.json (default: RESULTS-sim)")
    args = ap.parse_args(argv)
    try:
        results = json.loads(args.results.read_text())
        from sim_inputs import cost_arms

        costs = {arm: Costs.load(args.costs, arm) for arm in cost_arms(args.costs)}
    except (OSError, ValueError, KeyError) as e:
        ap.error(f"cannot read the inputs: {e}")
    rows = validate(results, costs, args.repeats)
    print(
        "| MTBF s | arm | schedules | measured P50 (min-max) | simulated P50 (min-max) | agrees |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mtbf_s']:g} | {r['arm']} | {r['schedules']} | {r['measured_p50']:.3f} "
            f"({r['measured_min']:.3f}-{r['measured_max']:.3f}) | {r['predicted_p50']:.3f} "
            f"({r['predicted_min']:.3f}-{r['predicted_max']:.3f}) "
            f"| {'yes' if r['agrees'] else 'no'} |"
        )
    from common import write_results

    name = args.name or f"{args.results.stem}-sim"
    path = write_results(
        name, {"results": str(args.results), "costs": str(args.costs), "rows": rows}
    )
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
