"""Tables and the extrapolation of ``bench/scale/run.py``'s results.

Also a command of its own, to print a results file again or compare two (the same
phases and kinds, per node, side by side: a run against old code and one against new)::

    .venv/bin/python bench/scale/report.py bench/results/scale.json
    .venv/bin/python bench/scale/report.py bench/results/scale-old.json bench/results/scale-new.json
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TARGETS = (1_000, 10_000)
PAGE_KEYS = 1000
"""Entries one LIST page returns at most (S3's default and maximum ``max-keys``)."""
LISTS = ("ListObjectsV2", "ListObjects", "ListMultipartUploads", "ListParts")
PrintTable = Callable[[Sequence[str], Sequence[Sequence[object]], str], None]


def percentiles(xs: Sequence[float]) -> dict[str, Any]:
    """``{"n", "p50", "p90", "max"}`` (nearest rank); None values when ``xs`` is empty."""
    s = sorted(xs)

    def rank(q: float) -> float | None:
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] if s else None

    return {"n": len(s), "p50": rank(0.5), "p90": rank(0.9), "max": s[-1] if s else None}


def _attributed(ph: dict[str, Any]) -> bool:
    """Whether the phase's callers are nodes (per-node access keys), not one shared key."""
    callers = ph["counts"]["callers"]
    return bool(callers) and all(c.startswith("node-") for c in callers)


def per_node_counts(ph: dict[str, Any], kind: str, n: int) -> list[float] | None:
    """The phase's requests of ``kind`` per node (per step), in node order; None without
    per-node access keys."""
    if not _attributed(ph):
        return None
    nums = {int(c.rsplit("-", 1)[1]): v.get(kind, 0) for c, v in ph["counts"]["callers"].items()}
    base = min(nums) // n * n if nums else 0  # renamed nodes are N..2N-1
    steps = ph.get("steps", 1)
    return [nums.get(base + i, 0) / steps for i in range(n)]


def index_fit(xs: Sequence[float]) -> tuple[float, float, float]:
    """Least squares ``x_i = a + b*i``: ``(a, b, r)``, r the correlation (0 if flat)."""
    n = len(xs)
    mi, mx = (n - 1) / 2, sum(xs) / n
    sii = sum((i - mi) ** 2 for i in range(n))
    sxx = sum((x - mx) ** 2 for x in xs)
    sxi = sum((i - mi) * (x - mx) for i, x in enumerate(xs))
    b = sxi / sii if sii else 0.0
    r = sxi / math.sqrt(sii * sxx) if sii and sxx else 0.0
    return mx - b * mi, b, r


def extrapolate(
    phases: list[dict[str, Any]], n: int, lists: Sequence[str] = LISTS
) -> dict[str, Any]:
    """Per-node counts scaled to :data:`TARGETS` nodes, per phase and kind.

    ``requests_at`` assumes each node makes as many requests as here (per step, for
    ``step``), unless the count per node grows with the node's place in the job
    (``grows_with_node_index``: correlation above 0.8, and the last node making at least
    half the mean more than the first): then node i makes ``a + b*i`` (a least-squares
    fit), and M nodes ``a*M + b*M*(M-1)/2``. LISTs get a second model: the entries each
    listing returned that belong to *other* nodes grow with the node count (own and
    unattributed entries stay), and a listing takes ``ceil(entries / 1000)`` pages, so
    ``list_requests_at`` and ``entries_listed_at`` grow with it. Without per-node access
    keys every entry counts as growing with the node count.
    """
    out: dict[str, Any] = {
        "nodes_measured": n,
        "targets": list(TARGETS),
        "page_keys": PAGE_KEYS,
        "model": extrapolate.__doc__,
        "phases": {},
    }
    for ph in phases:
        per = n * ph.get("steps", 1)
        attributed = _attributed(ph)
        kinds: dict[str, Any] = {}
        total = dict.fromkeys(map(str, TARGETS), 0.0)
        for kind, st in ph["counts"]["kinds"].items():
            e: dict[str, Any] = {"per_node": st["count"] / per}
            e["requests_at"] = {str(m): e["per_node"] * m for m in TARGETS}
            xs = per_node_counts(ph, kind, n)
            if xs is not None and n >= 3:
                a, b, r = index_fit(xs)
                e.update(per_node_min=min(xs), per_node_max=max(xs), fit={"a": a, "b": b, "r": r})
                if r > 0.8 and b * (n - 1) > 0.5 * (sum(xs) / n):
                    e["grows_with_node_index"] = True
                    e["requests_at"] = {str(m): a * m + b * m * (m - 1) / 2 for m in TARGETS}
            at = dict(e["requests_at"])
            if kind in lists and st["listings"]:
                entries = st["keys"] + st["prefixes"]
                listing = entries / st["listings"]
                share = st["keys_other"] / entries if entries and attributed else 1.0
                L = st["listings"] / per
                grown, at, listed = {}, {}, {}
                for m in TARGETS:
                    factor = m / n
                    if attributed:  # own and unattributed entries stay, others' grow
                        factor = (m - 1) / (n - 1) if n > 1 else float(m)
                    size = listing * (1 - share) + listing * share * factor
                    grown[str(m)] = size
                    at[str(m)] = L * max(1, math.ceil(size / PAGE_KEYS)) * m
                    listed[str(m)] = L * size * m
                e.update(
                    listings_per_node=L,
                    entries_per_listing=listing,
                    other_nodes_share=share,
                    entries_per_listing_at=grown,
                    list_requests_at=at,
                    entries_listed_at=listed,
                )
            for key in total:
                total[key] += at[key]
            kinds[kind] = e
        out["phases"][ph["name"]] = {
            "per": "node-step" if ph.get("steps", 1) > 1 else "node",
            "requests_per_node": ph["counts"]["total"] / per,
            "requests_at": total,
            "kinds": kinds,
        }
    return out


def _mib(b: float) -> float:
    return b / 2**20


REQUEST_COLUMNS = ["phase", "kind", "requests", "per node", "per node-step", "node min-max",
                   "4xx", "ranged", "listings", "entries listed", "entries/LIST",
                   "others' keys", "MiB"]  # fmt: skip


def request_rows(phases: list[dict[str, Any]], n: int) -> list[list[object]]:
    """Rows of the requests table (:data:`REQUEST_COLUMNS`): phase x kind, busiest kinds
    first, then the phase's total."""
    rows: list[list[object]] = []
    for ph in phases:
        name, steps = ph["name"], ph.get("steps", 1)
        for kind, count in ph.get("stop_counts", {}).items():  # the daemons' SIGTERM
            rows.append([f"{name} (stop)", kind, count, count / n])
        kinds = sorted(ph["counts"]["kinds"].items(), key=lambda kv: -kv[1]["count"])
        for kind, st in kinds:
            xs = per_node_counts(ph, kind, n)
            spread = f"{min(xs):g}-{max(xs):g}" if xs else None
            per_step = st["count"] / n / steps if steps > 1 else None
            ranged = st["ranged"] if kind == "GetObject" else None
            row = [name, kind, st["count"], st["count"] / n, per_step, spread]
            row += [st["status"].get("4xx"), ranged]
            if kind in LISTS:
                entries = st["keys"] + st["prefixes"]
                per_list = entries / st["count"] if st["count"] else None
                row += [st["listings"], entries, per_list, st["keys_other"]]
            else:
                row += [None] * 4
            rows.append([*row, _mib(st["req_bytes"] + st["resp_bytes"])])
        total = ph["counts"]["total"]
        rows.append([name, "TOTAL", total, total / n, total / n / steps if steps > 1 else None])
    width = len(REQUEST_COLUMNS)
    return [r + [None] * (width - len(r)) for r in rows]


def latency_rows(phases: list[dict[str, Any]]) -> list[list[object]]:
    """Rows of the timing table (seconds)."""
    rows: list[list[object]] = []

    def add(phase: str, what: str, t: dict[str, Any], extra: str = "") -> None:
        rows.append(
            [
                phase,
                what,
                t.get("n"),
                t.get("p50"),
                t.get("p90"),
                t.get("max"),
                t.get("first_done_s"),
                t.get("all_done_s"),
                extra,
            ]
        )

    for ph in phases:
        if "startup" in ph:
            st = ph["startup"]
            add(ph["name"], "daemon ready", {**st["ready_s"], "all_done_s": st["all_ready_s"]})
        for s in ph.get("per_step", []):
            err = f"{len(s['errors'])} errors" if s["errors"] else ""
            add(ph["name"], f"step {s['step']} save()", s["save_s"])
            add(ph["name"], f"step {s['step']} durable", s["durable_s"], err)
        if "restore" in ph:
            extra = f"steps {ph['restored_steps']}, {ph['mismatches']} mismatches"
            if ph["errors"]:
                extra += f", {len(ph['errors'])} errors"
            add(ph["name"], "restore()", ph["restore"], extra)
    return rows


def print_report(results: dict[str, Any], n: int, print_table: PrintTable) -> None:
    """Every table of one run."""
    phases = results["phases"]
    print_table(
        REQUEST_COLUMNS,
        request_rows(phases, n),
        f"S3 requests by phase and kind ({n} nodes; entries: keys + common prefixes)",
    )
    pattern_rows = [
        [ph["name"], kind, pat, count]
        for ph in phases
        for kind, pats in ph["counts"]["patterns"].items()
        if kind in LISTS
        for pat, count in sorted(pats.items(), key=lambda kv: -kv[1])[:4]
    ]
    print_table(
        ["phase", "kind", "prefix listed", "requests"],
        pattern_rows,
        "What the LISTs listed (node ids as <node>, numbers as <n>)",
    )
    print_table(
        ["phase", "what", "n", "p50", "p90", "max", "first done", "all done", "note"],
        latency_rows(phases),
        "Timings (s; first/all done: from the phase's first call)",
    )
    rows: list[list[object]] = []
    for name, e in results["extrapolation"]["phases"].items():
        notes = []
        for k, x in e["kinds"].items():
            now = x.get("entries_per_listing", 0.0)
            then = x.get("entries_per_listing_at", {}).get(str(TARGETS[-1]), 0.0)
            if then > 1.5 * now:
                notes.append(f"{k}: {now:.1f} -> {then:,.0f} entries/listing")
            if x.get("grows_with_node_index"):
                notes.append(f"{k}: per node grows with node index")
        at = [f"{e['requests_at'][str(m)]:,.0f}" for m in TARGETS]
        rows.append([name, e["per"], e["requests_per_node"], *at, "; ".join(notes) or None])
    print_table(
        ["phase", "per", "requests/node", *(f"at {m:,} nodes" for m in TARGETS), "why not linear"],
        rows,
        "Extrapolation: the job's requests (per step for step) at more nodes",
    )


def compare(a: dict[str, Any], b: dict[str, Any], print_table: PrintTable) -> None:
    """Per-node requests of two runs, phase x kind, side by side."""
    na, nb = a["config"]["nodes"], b["config"]["nodes"]
    pa = {ph["name"]: ph for ph in a["phases"]}
    pb = {ph["name"]: ph for ph in b["phases"]}
    rows: list[list[object]] = []
    for name in [*pa, *(x for x in pb if x not in pa)]:
        ka = pa.get(name, {"counts": {"kinds": {}}})["counts"]["kinds"]
        kb = pb.get(name, {"counts": {"kinds": {}}})["counts"]["kinds"]
        for kind in sorted({*ka, *kb}):
            sa = pa.get(name, {}).get("steps", 1)
            sb = pb.get(name, {}).get("steps", 1)
            x = ka[kind]["count"] / na / sa if kind in ka else 0.0
            y = kb[kind]["count"] / nb / sb if kind in kb else 0.0
            ex = (ka.get(kind, {}).get("keys", 0), kb.get(kind, {}).get("keys", 0))
            rows.append([name, kind, x, y, y / x if x else None, ex if kind in LISTS else None])
    la, lb = a["config"].get("label") or "A", b["config"].get("label") or "B"
    print_table(
        ["phase", "kind", f"{la}/node", f"{lb}/node", f"{lb}/{la}", "keys listed"],
        rows,
        f"Per-node requests ({la}: {na} nodes, {lb}: {nb} nodes; step: per node-step)",
    )


def main() -> None:
    """``report.py RESULTS.json [OTHER.json]``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from common import print_table

    docs = [json.loads(Path(p).read_text()) for p in sys.argv[1:3]]
    if not docs:
        sys.exit(__doc__)
    if len(docs) == 1:
        print_report(docs[0], docs[0]["config"]["nodes"], print_table)
    else:
        compare(docs[0], docs[1], print_table)


if __name__ == "__main__":
    main()
