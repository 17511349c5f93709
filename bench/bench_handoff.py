"""The handoff benchmark: what making ``save()`` crash-durable costs on small saves.

Since the journal, ``CommitShards`` is answered only after its record is fsynced
under the root. On large states that is noise; on small, frequent ones it is
the price. One run, interleaved repetitions, the same disk:

- ckptd: ``save()`` of a ``--kib`` KiB state in ``--arrays`` arrays, return
  latency (lease, copy, commit, journal fsync, answer); each save is waited to
  LOCAL afterwards, untimed, so the queue never grows;
- floor: what the journal itself needs per handoff, on the same directory: one
  record of the same size appended with ``write`` + ``fdatasync``, plus a
  memcpy of the state into a touched buffer (the copy every save makes).

Results: a table on stdout and ``bench/results/handoff.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    DEFAULT_WORK_DIR,
    Daemon,
    print_table,
    run_directory,
    source_digest,
    write_results,
)

from ckptd.client import Client


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kib", type=int, default=1024, help="state size per save (KiB)")
    p.add_argument("--arrays", type=int, default=64, help="arrays per state")
    p.add_argument("--saves", type=int, default=100, help="timed saves per repetition")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch directory")
    return p.parse_args(argv)


def _state(kib: int, arrays: int, seed: int) -> dict[str, np.ndarray]:
    n = max(1, kib * 1024 // 4 // arrays)
    rng = np.random.default_rng(seed)
    return {f"a{i}": rng.standard_normal(n, dtype=np.float32) for i in range(arrays)}


def _ckptd_arm(client: Client, args: argparse.Namespace, first_step: int) -> list[float]:
    out = []
    for i in range(args.saves):
        state = _state(args.kib, args.arrays, i)
        t0 = time.perf_counter()
        handle = client.save(first_step + i, state)
        out.append(time.perf_counter() - t0)
        handle.wait("local")  # untimed: keeps the write queue empty between saves
    return out


def _floor_arm(root: Path, args: argparse.Namespace, record_bytes: int) -> list[float]:
    state = _state(args.kib, args.arrays, 0)
    total = sum(a.nbytes for a in state.values())
    dst = np.zeros(total, np.uint8)  # touched once, reused, like a lease
    record = os.urandom(record_bytes)
    path = root / "floor.journal"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    out = []
    try:
        for _ in range(args.saves):
            t0 = time.perf_counter()
            at = 0
            for a in state.values():
                flat = a.view(np.uint8).reshape(-1)
                dst[at : at + flat.size] = flat
                at += flat.size
            os.write(fd, record)
            os.fdatasync(fd)
            out.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    return out


def _pct(samples: list[float], q: float) -> float:
    return float(np.quantile(samples, q))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the results written to bench/results/handoff.json."""
    args = parse_args(argv)
    samples: dict[str, list[float]] = {"ckptd": [], "floor": []}
    with run_directory(args.dir, "handoff") as run:
        daemon = Daemon(run / "root", extra_args=["--retention-local", "KeepLatest(2)"])
        daemon.start()
        try:
            client = Client("bench", daemon.socket)
            client.save(0, _state(args.kib, args.arrays, 0)).wait("local")  # warm the pool
            journal = daemon.root / ".journal"
            record = max(1024, journal.stat().st_size) if journal.exists() else 4096
            for rep in range(args.reps):
                arms = ["ckptd", "floor"] if rep % 2 == 0 else ["floor", "ckptd"]
                for arm in arms:
                    if arm == "ckptd":
                        samples[arm] += _ckptd_arm(client, args, 1 + rep * args.saves)
                    else:
                        samples[arm] += _floor_arm(daemon.root, args, record)
            client.close()
        finally:
            daemon.stop()
    rows = []
    summary: dict[str, Any] = {}
    for arm, label in (("ckptd", "ckptd save() returns"), ("floor", "floor: memcpy + fdatasync")):
        s = samples[arm]
        summary[arm] = {
            "p50_ms": 1e3 * statistics.median(s),
            "p99_ms": 1e3 * _pct(s, 0.99),
            "min_ms": 1e3 * min(s),
            "n": len(s),
        }
        rows.append([label, summary[arm]["p50_ms"], summary[arm]["p99_ms"], summary[arm]["min_ms"]])
    print_table(
        ["arm", "p50 ms", "p99 ms", "min ms"],
        rows,
        f"handoff of {args.kib} KiB in {args.arrays} arrays, {args.saves} x {args.reps} saves",
    )
    results = {
        "args": vars(args) | {"dir": str(args.dir)},
        "summary": summary,
        "ratio_p50": summary["ckptd"]["p50_ms"] / summary["floor"]["p50_ms"],
        "source_sha256": source_digest(),
    }
    write_results("handoff", results)
    return results


if __name__ == "__main__":
    main()
