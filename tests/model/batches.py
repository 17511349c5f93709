"""The long model-checker run in batches, several at once: ``make model-check`` with
``CKPTD_MODEL_WORKERS`` above 1.

Each batch is one pytest run of the ``model``-marked long run with its own seed
(``CKPTD_MODEL_SEED`` + batch number: other sequences each) and its own report; at
most ``CKPTD_MODEL_WORKERS`` run at once, each with its own daemons, bucket and
peer. A sequence waits mostly on processes (daemon starts, kills, the bucket), so
batches side by side use the cores a single run leaves idle. The reports are
merged into ``CKPTD_MODEL_REPORT`` as each batch ends, so a run stopped early still
reports what it did; a batch that fails keeps its shrunk failure in its log
(``<report>.d/batch-N.log``) and in ``.hypothesis/``.

Run from the repository root: ``python tests/model/batches.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

SUMMED = ("sequences", "operations", "invariants_checked", "failing_runs")
OURS = ("CKPTD_MODEL_WORKERS", "CKPTD_MODEL_BATCH")
COUNTED = ("operations_by_kind", "seconds_by_kind", "copies_read_by_tier")


def merge(reports: list[dict[str, Any]], seconds: float, extra: dict[str, Any]) -> dict[str, Any]:
    """One report for the batches' reports (counts summed, failures listed)."""
    out: dict[str, Any] = {k: sum(r.get(k, 0) for r in reports) for k in SUMMED}
    out["sequences_passed_at_full_length"] = sum(
        r.get("sequences_passed_at_full_length", 0) for r in reports
    )
    for key in COUNTED:
        total: Counter[str] = Counter()
        for r in reports:
            total.update(r.get(key, {}))
        out[key] = {k: round(v, 1) for k, v in sorted(total.items())}
    out["slowest_quiet_seconds"] = max(
        (r.get("slowest_quiet_seconds", 0) for r in reports), default=0
    )
    out["failures"] = [f for r in reports for f in r.get("failures", [])]
    out["first_seen"] = [s for r in reports for s in r.get("first_seen", [])]
    out["failing_sequences"] = [t for r in reports for t in r.get("failing_sequences", [])]
    out["seconds"] = round(seconds, 1)
    out.update(extra)
    return out


def main() -> int:
    knob = os.environ.get
    total = int(knob("CKPTD_MODEL_SEQUENCES") or 1000)
    steps = int(knob("CKPTD_MODEL_STEPS") or 20)
    workers = max(1, int(knob("CKPTD_MODEL_WORKERS") or 2))
    batch = max(1, int(knob("CKPTD_MODEL_BATCH") or 25))
    seed = int(knob("CKPTD_MODEL_SEED") or int(time.time()))
    report = Path(knob("CKPTD_MODEL_REPORT") or "bench/results/model-check.json")
    parts = report.with_name(report.name + ".d")
    parts.mkdir(parents=True, exist_ok=True)
    sizes = [min(batch, total - start) for start in range(0, total, batch)]
    began = time.monotonic()
    running: dict[int, subprocess.Popen[bytes]] = {}
    done: dict[int, dict[str, Any]] = {}
    failed: list[int] = []
    queue = list(enumerate(sizes))

    def start(n: int, size: int) -> None:
        env = {k: v for k, v in os.environ.items() if k not in OURS}  # not daemon settings
        env.update(
            CKPTD_MODEL_SEQUENCES=str(size),
            CKPTD_MODEL_STEPS=str(steps),
            CKPTD_MODEL_SEED=str(seed + n),
            CKPTD_MODEL_REPORT=str(parts / f"batch-{n}.json"),
        )
        log = open(parts / f"batch-{n}.log", "wb")  # noqa: SIM115 (closed with the process)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "model"]
        running[n] = subprocess.Popen([*cmd, "tests/model"], env=env, stdout=log, stderr=log)
        log.close()

    while queue or running:
        while queue and len(running) < workers:
            start(*queue.pop(0))
        n, proc = next(iter(running.items()))
        for m, p in running.items():  # whichever ends first
            if p.poll() is not None:
                n, proc = m, p
                break
        else:
            time.sleep(1.0)
            continue
        del running[n]
        if proc.returncode != 0:
            failed.append(n)
        try:
            done[n] = json.loads((parts / f"batch-{n}.json").read_text())
        except (OSError, ValueError):
            failed.append(n)
        merged = merge(
            [done[k] for k in sorted(done)],
            time.monotonic() - began,
            {
                "sequences_asked": total,
                "steps_per_sequence": steps,
                "seed": seed,
                "workers": workers,
                "batches_done": len(done),
                "batches_failed": sorted(set(failed)),
            },
        )
        report.write_text(json.dumps(merged, indent=2) + "\n")
        print(
            f"batch {n} ({sizes[n]} sequences) {'FAILED' if n in failed else 'passed'}: "
            f"{merged['sequences']} sequences, {merged['operations']} operations, "
            f"{merged['invariants_checked']} invariants checked in {merged['seconds']:.0f} s",
            flush=True,
        )
    print(json.dumps(merged, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
