"""The goodput benchmark's arithmetic: event lines -> per-run figures -> cells -> table
and plot (bench/goodput/run.py runs the jobs)."""

from __future__ import annotations

import itertools
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

CAL_EVERY = 5
"""The Young/Daly arms' calibration run saves every CAL_EVERY steps."""
HEADERS = ["arm", "MTBF s", "goodput", "spread", "lost P50/P90 s", "restored P50/P90 s",
           "restore call P50/P90 s", "memory/disk", "first step P50 s", "interval P50 s",
           "overhead %", "bit-exact"]  # fmt: skip
"""The table's columns (:func:`row_of`). restored: process start to state restored
(every restart); restore call: the restore alone, and memory/disk: where it came
from; first step: process start to the first step done (restore call and first step:
restarts that restored a checkpoint)."""


def step_times(steps: list[Any]) -> list[float]:
    """Seconds between consecutive steps, after a life's first two (compilation)."""
    return [b[1] - a[1] for a, b in itertools.pairwise(steps[2:])]


def parse(path: Path) -> list[list[str]]:
    """The job's event lines (a torn last line, from a kill mid-write, dropped)."""
    text = path.read_text() if path.exists() else ""
    lines = text.split("\n")[:-1]  # the part after the last newline is torn or empty
    return [ln.split() for ln in lines if ln]


def still_restoring(events: list[list[str]]) -> bool:
    """Whether the run's last process had done no step when the time was up."""
    last = max((i for i, e in enumerate(events) if e[0] == "start"), default=-1)
    return not any(e[0] == "step" for e in events[last + 1 :])


def calibration(work: Path) -> dict[str, Any]:
    """The calibration figures from the uninterrupted runs' event files."""
    steps = [(int(e[1]), float(e[2]), e[3]) for e in parse(work / "noop" / "progress.log")
             if e[0] == "step" and len(e) == 4]  # fmt: skip
    dts = step_times(steps)
    base = statistics.median(dts)
    reference = {s: bits for s, _, bits in steps}
    cal: dict[str, Any] = {
        "base_step_s": base,
        "steps_per_s": 1.0 / base,
        "noop_mean_step_s": statistics.fmean(dts),
        "reference_steps": len(reference),
        "yd_cost_s": None,
        "_reference": reference,
    }
    # Saving every CAL_EVERY steps: its steps' slowdown per save is its effective cost.
    for name in ("yd-cal", "orbax-cal"):  # orbax-cal: a run of an earlier version
        if (work / name / "progress.log").exists():
            o_dts = step_times([(int(e[1]), float(e[2])) for e in
                                parse(work / name / "progress.log")
                                if e[0] == "step" and len(e) == 4])  # fmt: skip
            cal["yd_cost_s"] = max((statistics.fmean(o_dts) - base) * CAL_EVERY, 0.0)
            break
    return cal


def summarize(
    events: list[list[str]],
    seconds: float,
    rate: float,
    base_step: float,
    reference: dict[int, str],
    final_probe: int | None = None,
) -> dict[str, Any]:
    """Goodput and the rest from one run's event lines. ``final_probe``: the step the
    newest checkpoint holds, for a run whose last process had not restored yet when
    the time was up (its progress is that checkpoint's)."""
    lives: list[dict[str, Any]] = []
    policy: list[tuple[float, ...]] = []  # Goodput()'s (interval, cost, base) per save
    for e in events:
        if e[0] == "start":
            lives.append({"start": float(e[1]), "steps": [], "saves": [], "restored": None,
                          "call": None})  # fmt: skip
        elif not lives:
            continue
        elif e[0] == "restored" and len(e) == 3:
            lives[-1]["restored"] = (int(e[1]), float(e[2]))
        elif e[0] == "restore" and len(e) == 5:
            lives[-1]["call"] = (float(e[3]) - float(e[2]), e[4])
        elif e[0] == "step" and len(e) == 4:
            lives[-1]["steps"].append((int(e[1]), float(e[2]), e[3]))
        elif e[0] == "saved" and len(e) == 3:
            lives[-1]["saves"].append((int(e[1]), float(e[2])))
        elif e[0] == "policy" and len(e) in (4, 5):
            policy.append(tuple(float(x) for x in e[1:] if x != "None"))
    last = lives[-1] if lives else {"steps": [], "restored": None}
    if last["steps"]:
        final = max(s[0] for s in last["steps"])
    elif last["restored"]:
        final = last["restored"][0]
    else:
        final = final_probe or 0
    lost, restore, intervals, dts = [], [], [], []
    restarts: list[dict[str, Any]] = []  # each restart's parts (the memory tier's figures)
    mismatched = 0
    reached: int | None = None  # the progress of the last process that restored
    for i, life in enumerate(lives):
        if life["restored"] is None:
            continue  # killed before it restored: it held no progress of its own
        if i > 0:  # the first process starts the run; the others restart after a failure
            restore.append(life["restored"][1] - life["start"])
            restarts.append({
                "step": life["restored"][0],  # 0: no checkpoint yet, a fresh start
                "restored_s": restore[-1],
                "restore_call_s": life["call"][0] if life["call"] else None,
                "tier": life["call"][1] if life["call"] else None,
                # The first step pays for what the restore left undone (pages mapped
                # lazily) and for compiling, the same in every arm.
                "first_step_s": life["steps"][0][1] - life["start"] if life["steps"] else None,
            })  # fmt: skip
        if reached is not None:  # a failure: what was reached minus what came back
            lost.append((reached - life["restored"][0]) * base_step)
        reached = max((s[0] for s in life["steps"]), default=life["restored"][0])
    for life in lives:
        times = [t for _, t in life["saves"]]
        intervals += [b - a for a, b in itertools.pairwise(times)]
        steps = life["steps"]
        dts += step_times(steps)
        mismatched += sum(1 for s, _, bits in steps if s in reference and reference[s] != bits)
    compared = sum(1 for life in lives for s, _, _ in life["steps"] if s in reference)

    def pct(xs: list[float], q: float) -> float | None:
        return float(np.percentile(xs, q)) if xs else None

    mean_dt = statistics.fmean(dts) if dts else None
    calls = [r["restore_call_s"] for r in restarts if r["restore_call_s"] is not None]
    # Restarts that restored a checkpoint (a fresh start's first step has no restore).
    firsts = [r["first_step_s"] for r in restarts if r["tier"] and r["first_step_s"] is not None]
    return {
        "goodput": final / (seconds * rate),
        "final_step": final,
        "failures": len(lives) - 1,
        "lost_s_p50": pct(lost, 50),
        "lost_s_p90": pct(lost, 90),
        "restore_s_p50": pct(restore, 50),
        "restore_s_p90": pct(restore, 90),
        "restore_call_s_p50": pct(calls, 50),
        "restore_call_s_p90": pct(calls, 90),
        "first_step_s_p50": pct(firsts, 50),
        "restores_from_memory": sum(1 for r in restarts if r["tier"] == "memory"),
        "restores_from_disk": sum(1 for r in restarts if r["tier"] == "disk"),
        "restarts": restarts,
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
        "policy_mtbf_s": policy[-1][3] if policy and len(policy[-1]) > 3 else None,
    }


def row_of(s: dict[str, Any]) -> list[str]:
    """One summary line of the table."""
    return [
        s["arm"], f"{s['mtbf_s']:g}", f"{s['goodput']:.3f}",
        f"{s['goodput_min']:.3f}-{s['goodput_max']:.3f}",
        f"{fmt(s['lost_s_p50'])}/{fmt(s['lost_s_p90'])}",
        f"{fmt(s['restore_s_p50'])}/{fmt(s['restore_s_p90'])}",
        f"{fmt(s['restore_call_s_p50'])}/{fmt(s['restore_call_s_p90'])}",
        f"{s['restores_from_memory']}/{s['restores_from_disk']}",
        fmt(s["first_step_s_p50"]),
        fmt(s["interval_s_p50"]), fmt(s["overhead_pct"], 1), str(s["bit_exact"]),
    ]  # fmt: skip


def fmt(v: float | None, digits: int = 2) -> str:
    """A number for the table, ``-`` for none."""
    return "-" if v is None else f"{v:.{digits}f}"


def summarize_cells(cells: list[dict[str, Any]], args: Any) -> list[dict[str, Any]]:
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
                "restore_call_s_p50": med("restore_call_s_p50"),
                "restore_call_s_p90": med("restore_call_s_p90"),
                "first_step_s_p50": med("first_step_s_p50"),
                "restores_from_memory": sum(r.get("restores_from_memory", 0) for r in rs),
                "restores_from_disk": sum(r.get("restores_from_disk", 0) for r in rs),
                "interval_s_p50": med("interval_s_p50"), "overhead_pct": med("overhead_pct"),
                "noop_step_s": med("noop_step_s"),
                "bit_exact": all(r["bit_exact"] for r in rs),
            })  # fmt: skip
    return out


def plot(
    summary: list[dict[str, Any]],
    path: Path,
    cal: dict[str, Any],
    variant: str = "trainer",
    framework: str = "jax",
) -> None:
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
    what = "trainer SIGKILLed" if variant == "trainer" else "node lost (daemon, disk)"
    ax.set_xlabel(f"MTBF (s), {what} at exponential times")
    ax.set_ylabel("goodput")
    ax.set_title(
        f"Goodput under failures: {'PyTorch' if framework == 'torch' else 'JAX'} MLP, "
        f"{cal['base_step_s'] * 1e3:.0f} ms steps "
        "(median, min-max over schedules)",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
