"""Goodput vs MTBF per arm from a simulator results file (bench/goodput/sim_run.py).

One panel per failure mix (Weibull shape, node-loss fraction) in the file; per
arm the mean goodput with its 95% confidence interval as error bars, the
oracle (the best fixed interval, found with the true MTBF) as a dashed line;
MTBF on a log axis.

    .venv/bin/python bench/goodput/sim_plot.py [bench/results/goodput-sim.json] [--out PNG]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
_STYLE = {  # ckptd's arms solid, the peers dashed-dotted; fixed colours across figures
    "goodput": ("tab:blue", "o", "-"),
    "goodput-mtbf": ("tab:cyan", "s", "-"),
    "continuous": ("tab:green", "^", "-"),
    "young-daly": ("tab:olive", "v", "-"),
    "orbax-continuous": ("tab:red", "D", "-."),
    "orbax-yd": ("tab:orange", "P", "-."),
    "dcp-yd": ("tab:purple", "X", "-."),
    "dlrover": ("tab:brown", "*", "-."),
}


def _mix(cell: dict[str, Any], doc: dict[str, Any]) -> tuple[float, float]:
    """A cell's failure mix; files written before cells carried it hold one, on top."""

    def one(key: str, default: float) -> float:
        v = cell.get(key, doc.get(key, default))
        return float(v[0] if isinstance(v, list) else v)

    return one("weibull_shape", 1.0), one("node_fraction", 0.0)


def _by_mix(results: Path) -> tuple[dict[str, Any], dict[tuple[float, float], list[Any]]]:
    """The results file and its cells by failure mix."""
    doc = json.loads(Path(results).read_text())
    cells = doc.get("cells") if isinstance(doc, dict) else None
    if not cells:
        raise ValueError(f"{results} has no cells: is it a sim_run.py results file?")
    mixes: dict[tuple[float, float], list[dict[str, Any]]] = {}
    for c in cells:
        mixes.setdefault(_mix(c, doc), []).append(c)
    return doc, mixes


def panels(results: Path) -> list[tuple[float, float]]:
    """The failure mixes (Weibull shape, node-loss fraction) the figure has a panel
    for, in order."""
    return sorted(_by_mix(results)[1])


def plot(results: Path, out: Path | None = None) -> Path:
    """Draw ``results`` (a sim_run JSON file) to ``out`` (default: the same name,
    .png); returns the path written."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a bench host
    import matplotlib.pyplot as plt

    doc, mixes = _by_mix(results)
    cols = min(len(mixes), 2)  # two panels a row: the figure stays readable on a page
    rows = -(-len(mixes) // cols)
    fig, grid = plt.subplots(
        rows, cols, figsize=(6.5 * cols, 4.8 * rows), squeeze=False, sharey=True
    )
    axes = [ax for row in grid for ax in row]
    for ax in axes[len(mixes) :]:
        ax.set_visible(False)
    for ax, ((shape, nodes), group) in zip(axes, sorted(mixes.items()), strict=False):
        group = sorted(group, key=lambda c: c["mtbf_seconds"])
        x = [c["mtbf_seconds"] for c in group]
        names = [n for n in group[0]["arms"] if n != "oracle"]
        for i, name in enumerate(names):
            colour, marker, line = _STYLE.get(name, ("tab:gray", ".", ":"))
            # a small horizontal stagger so that overlapping error bars stay readable
            xs = [v * 1.025 ** (i - len(names) / 2) for v in x]
            y = [c["arms"][name]["mean"] for c in group]
            err = [c["arms"][name]["ci95"] for c in group]
            ax.errorbar(
                xs,
                y,
                yerr=err,
                label=name,
                color=colour,
                marker=marker,
                linestyle=line,
                capsize=3,
                markersize=5,
            )
        if "oracle" in group[0]["arms"]:
            ax.plot(x, [c["arms"]["oracle"]["mean"] for c in group], "k--", label="oracle")
        ax.set_xscale("log")
        ax.set_xlabel("MTBF (s)")
        kind = "exponential" if shape == 1 else f"Weibull shape {shape:g}"
        ax.set_title(f"{kind}, node losses {100 * nodes:g}%")
        ax.grid(True, which="both", alpha=0.3)
    for row in grid:
        row[0].set_ylabel("goodput (mean, 95% CI)")
    axes[len(mixes) - 1].legend(fontsize=8, loc="lower right")
    hours = doc.get("horizon_hours")
    fig.suptitle(
        f"Simulated goodput: {doc.get('traces', '?')} traces of {hours:g} h per cell"
        if isinstance(hours, int | float)
        else "Simulated goodput"
    )
    fig.tight_layout()
    out = Path(out) if out is not None else Path(results).with_suffix(".png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    """The CLI: one results file in, one PNG out."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path, nargs="?", default=RESULTS / "goodput-sim.json")
    ap.add_argument("--out", type=Path, help="default: the results file's name, .png")
    args = ap.parse_args(argv)
    try:
        print(plot(args.results, args.out))
    except (OSError, ValueError) as e:
        ap.error(f"{e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
