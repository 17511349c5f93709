"""The arithmetic of bench/goodput/costs.py: the job's event lines and the daemon's step
events -> samples of each cost -> the costs file's entries and the table
(tests/test_goodput_costs.py)."""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

COSTS = ("step", "save_blocking", "save_effective", "to_local", "to_durable", "restart",
         "node_restart")  # fmt: skip
"""The costs of the costs file, in the table's order."""


def lives(events: list[list[str]]) -> list[list[list[str]]]:
    """The event lines split into the job's lives (each begins with ``start``)."""
    out: list[list[list[str]]] = []
    for e in events:
        if e[0] == "start" or not out:
            out.append([])
        out[-1].append(e)
    return out


def steps_of(life: list[list[str]]) -> list[tuple[int, float, float]]:
    """(step, begin, end) of every step of one life but its first (which follows the
    restore): a step begins when the previous step ended or, after a save, when
    save() returned."""
    out: list[tuple[int, float, float]] = []
    begin: float | None = None
    for e in life:
        if e[0] == "step" and len(e) == 4:
            if begin is not None:
                out.append((int(e[1]), begin, float(e[2])))
            begin = float(e[2])
        elif e[0] == "saved" and len(e) == 3 and begin is not None:
            begin = float(e[2])
    return out


def saves_of(
    events: list[list[str]], reached: dict[int, tuple[float | None, float | None]]
) -> list[dict[str, Any]]:
    """Every save: its step, life, start, return, LOCAL and DURABLE times (None where
    not reached). ``reached``: step -> (LOCAL, DURABLE) from the daemon's events; a
    ``local`` event line (Orbax's finalization) stands for both."""
    out: list[dict[str, Any]] = []
    for n, life in enumerate(lives(events)):
        mine: dict[int, dict[str, Any]] = {}  # this life's saves by step
        for e in life:
            if e[0] == "saving" and len(e) == 3:
                step = int(e[1])
                local, durable = reached.get(step, (None, None))
                mine[step] = {"step": step, "life": n, "start": float(e[2]), "returned": None,
                              "local": local, "durable": durable}  # fmt: skip
                out.append(mine[step])
            elif e[0] == "saved" and len(e) == 3 and int(e[1]) in mine:
                mine[int(e[1])]["returned"] = float(e[2])
            elif e[0] == "local" and len(e) == 3 and int(e[1]) in mine:
                # Orbax finalizes a save while the next one waits for it: its line may
                # come after the next save's "saving".
                mine[int(e[1])]["local"] = mine[int(e[1])]["durable"] = float(e[2])
    return out


def measure(
    events: list[list[str]], reached: dict[int, tuple[float | None, float | None]]
) -> dict[str, Any]:
    """Samples of step, save_blocking, save_effective (and the steps each spreads
    over), to_local and to_durable from one arm's event lines. to_durable counts the
    saves made on an idle drain (every earlier save DURABLE by their start): one
    queued behind an upload measures the queue; ``to_durable_queued`` has them all."""
    saves = saves_of(events, reached)
    by_life = [steps_of(life) for life in lives(events)]
    # A save is in flight from its start until DURABLE (or LOCAL; to the life's end
    # if neither came): the drain's upload may slow steps too.
    busy = [[(s["start"], s["durable"] or s["local"] or math.inf) for s in saves
             if s["life"] == n] for n in range(len(by_life))]  # fmt: skip
    quiet = [end - begin for n, steps in enumerate(by_life) for _, begin, end in steps
             if not any(b < end and begin < e for b, e in busy[n])]  # fmt: skip
    if not quiet:
        raise ValueError("no step ran without a save in flight: raise --interval-steps")
    base = statistics.median(quiet)
    out: dict[str, Any] = {"step": quiet, "save_blocking": [], "save_effective": [],
                           "spread_steps": [], "to_local": [], "to_durable": [],
                           "to_durable_queued": []}  # fmt: skip
    out["save_index"] = []
    for s in saves:
        if s["returned"] is None or s["local"] is None:
            continue  # killed before it was restorable
        # the save's place in its life: a life's first saves pay for warming up
        out["save_index"].append(
            sum(1 for p in saves if p["life"] == s["life"] and p["start"] <= s["start"])
        )
        out["save_blocking"].append(s["returned"] - s["start"])
        out["to_local"].append(s["local"] - s["start"])
        if s["durable"] is not None:
            out["to_durable_queued"].append(s["durable"] - s["start"])
            earlier = [p["durable"] for p in saves if p["start"] < s["start"]]
            if all(d is None or d <= s["start"] for d in earlier):
                out["to_durable"].append(s["durable"] - s["start"])
        after = [end - begin for _, begin, end in by_life[s["life"]]
                 if s["returned"] <= begin < s["local"]]  # fmt: skip
        out["save_effective"].append(sum(max(0.0, d - base) for d in after))
        out["spread_steps"].append(len(after))
    return out


def restarts(events: list[list[str]], kills: Sequence[float], step: float) -> list[float]:
    """Seconds from each kill to the start of the new process's first step: to the
    first step logged after it, less ``step`` (an undisturbed step: the simulator
    runs that step itself; what the first step takes beyond it, e.g. compiling,
    stays in the restart)."""
    steps = sorted(float(e[2]) for e in events if e[0] == "step" and len(e) == 4)
    out = []
    for k in kills:
        first = next((t for t in steps if t > k), None)
        if first is not None:
            out.append(max(first - k - step, 0.0))
    return out


def interval_of(events: list[list[str]]) -> float:
    """The median seconds between two save starts of one life (the pace the save
    costs were measured at)."""
    gaps = []
    for life in lives(events):
        starts = [float(e[2]) for e in life if e[0] == "saving" and len(e) == 3]
        gaps += [b - a for a, b in itertools.pairwise(starts)]
    return statistics.median(gaps) if gaps else 0.0


def quantiles(samples: Sequence[float]) -> tuple[float, float, float]:
    """(median, P10, P90)."""
    q = np.quantile(np.asarray(samples, dtype=float), [0.5, 0.1, 0.9])
    return float(q[0]), float(q[1]), float(q[2])


FIRST_SAVES = 2
"""A life's first saves measured apart: they pay for warming up (a new process's
first leases, fresh memory for the segment the memory tier keeps, Orbax's first
async save), which the saves after them do not."""
_PER_SAVE = ("save_blocking", "save_effective", "to_local")


def split_first_saves(
    measured: dict[str, Any],
) -> tuple[dict[str, list[float]], list[dict[str, list[float]]]]:
    """The per-save samples (``_PER_SAVE``) of the saves after a life's first
    :data:`FIRST_SAVES`, and those of each of the first; all in the first part, and
    no first saves, where the lives were too short to have saves after them."""
    index = measured.get("save_index") or []
    later = [i for i, n in enumerate(index) if n > FIRST_SAVES]
    if not later:
        return {k: list(measured[k]) for k in _PER_SAVE}, []
    pick = lambda rows: {k: [measured[k][i] for i in rows] for k in _PER_SAVE}  # noqa: E731
    firsts = [pick([i for i, n in enumerate(index) if n == k]) for k in range(1, FIRST_SAVES + 1)]
    return pick(later), [f for f in firsts if f["save_blocking"]]


def arm_costs(measured: dict[str, Any], kills: dict[str, list[float]]) -> dict[str, Any]:
    """One arm's ARMCOSTS for the costs file ({"samples": [...]} each): the save costs
    of a life's later saves, ``first_saves`` for each of its first ones."""
    out: dict[str, Any] = {}
    later, firsts = split_first_saves(measured)
    for key in ("save_blocking", "save_effective", "to_local", "to_durable"):
        samples = later[key] if key in later else measured[key]
        if not samples and key == "to_durable":
            continue  # saves so close together that the drain was never idle: see pace_of
        if not samples:
            raise ValueError(f"no save measured its {key}: run longer (--saves)")
        out[key] = {"samples": [round(v, 6) for v in samples]}
    if firsts:
        out["first_saves"] = [
            {k: {"samples": [round(v, 6) for v in f[k]]} for k in _PER_SAVE} for f in firsts
        ]
    out["effective_spread_steps"] = max(1, math.ceil(statistics.median(measured["spread_steps"])))
    if measured.get("interval_s"):
        out["interval_s"] = round(measured["interval_s"], 3)
    for key in ("restart", "node_restart"):
        if kills.get(key):
            out[key] = {"samples": [round(v, 6) for v in kills[key]]}
    return out


def plan_of(restarts: int, node_restarts: int) -> list[str]:
    """The kills in order, node losses spread among the trainer restarts."""
    plan = ["restart"] * restarts
    for i in range(node_restarts):
        plan.insert(round((i + 1) * restarts / (node_restarts + 1)) + i, "node_restart")
    return plan


def table(doc: dict[str, Any]) -> list[list[object]]:
    """(arm, cost, median, P10, P90, n) rows of a costs file: the step (every arm's),
    then each arm's costs (restart and node_restart: the arm's, else the default)."""
    rows: list[list[object]] = []
    for arm, key, dist in [("all", "step", doc["step"])] + [
        (arm, key, costs.get(key, doc.get(key)))
        for arm, costs in doc["arms"].items()
        for key in COSTS[1:]
    ]:
        if isinstance(dist, dict) and dist.get("samples"):
            med, p10, p90 = quantiles(dist["samples"])
            rows.append([arm, key, f"{med:.3f}", f"{p10:.3f}", f"{p90:.3f}", len(dist["samples"])])
    return rows


def dumps(doc: dict[str, Any]) -> str:
    """``doc`` as indented JSON with each list of numbers on one line (the samples)."""
    text = json.dumps(doc, indent=1)
    numbers = re.compile(r"\[([-+0-9.eE,\s]*)\]")
    return numbers.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"
