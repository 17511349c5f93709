"""The simulator's results as text (bench/goodput/sim_run.py): the markdown table, and
the parsing of its command-line lists."""

from __future__ import annotations

import argparse
from typing import Any


def table(cells: list[dict[str, Any]]) -> str:
    """The cells as a markdown table, a row per arm: goodput (mean ± 95% CI), paired
    difference to the oracle, step-time overhead, and the interval where fixed."""
    rows = [
        "| MTBF s | mix | failures | arm | goodput | arm - oracle | overhead | interval |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        mix = f"w{c.get('weibull_shape', 1.0):g} n{c.get('node_fraction', 0.0):g}"
        for name, a in c["arms"].items():
            d, o = a["minus_oracle"], a.get("overhead")
            k = f"{a['steps']} steps" if a.get("steps") else ""
            if a.get("durable_steps"):
                k = f"{a.get('memory_steps') or 1} / {a['durable_steps']} steps"
            over = f"{100 * o['mean']:.2f}%" if o else ""
            rows.append(
                f"| {c['mtbf_seconds']:g} | {mix} | {c['failures_mean']:.1f} | {name} "
                f"| {a['mean']:.4f} ± {a['ci95']:.4f} | {d['mean']:+.4f} ± {d['ci95']:.4f} "
                f"| {over} | {k} |"
            )
    rows += ["", "| MTBF s | mix | goodput - peer, paired (mean ± 95% CI) |", "|---|---|---|"]
    for c in cells:
        mix = f"w{c.get('weibull_shape', 1.0):g} n{c.get('node_fraction', 0.0):g}"
        diffs = c["arms"]["goodput"].get("minus_peers", {})
        text = ", ".join(f"{p} {d['mean']:+.4f} ± {d['ci95']:.4f}" for p, d in diffs.items())
        rows.append(f"| {c['mtbf_seconds']:g} | {mix} | {text} |")
    return "\n".join(rows)


def floats(text: str) -> list[float]:
    """``a,b,c`` as numbers (argparse's type: a clear error otherwise)."""
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give numbers separated by commas, e.g. 600,3600"
        ) from None


def phases(text: str) -> list[tuple[float, float]]:
    """``MTBFxHOURS,...`` as ``(mtbf seconds, seconds)`` phases (argparse's type)."""
    try:
        out = [(float(m), 3600 * float(h)) for m, h in (p.split("x") for p in text.split(","))]
    except ValueError:
        out = []
    if not out or any(m <= 0 or s <= 0 for m, s in out):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give phases as MTBF-seconds x hours separated by commas, "
            "e.g. 21600x24,600x24"
        )
    return out


__all__ = ["floats", "phases", "table"]
