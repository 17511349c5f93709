"""Saves arriving faster than the disk takes them: does each reach LOCAL when the queue
says it should, and in the order it was acknowledged?

One client issues ``--saves`` saves of ``--mib`` MiB back to back (no wait between
them) against a daemon that writes every save (``--no-supersede-unwritten``) and
whose staging budget holds ``--budget`` saves, so the
first ones are acknowledged at once and later ``save()`` calls block on the
budget only. A thread per handle records when its save reaches LOCAL.

The model, measured in the same run: ``W``, the median handoff-to-LOCAL of the
same save made alone (the disk's time for one save). With one save written at a
time, save ``i`` reaches LOCAL at ``max(ack_i, LOCAL_{i-1}) + W``; its latency
beyond that is what the queue does not explain. Reported: each save's ack and
LOCAL latency, the ratio of actual to modelled latency (median and max), the
ratio of the whole run to ``saves x W``, and how many saves reached LOCAL out of
acknowledgement order. Results: a table on stdout and ``bench/results/overload.json``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import DEFAULT_WORK_DIR, Daemon, print_table, run_directory, write_results

from ckptd.client import Client
from ckptd.proto import ckptd_pb2 as pb


def state_of(mib: int, arrays: int) -> dict[str, np.ndarray]:
    """``mib`` MiB of float32 in ``arrays`` equal arrays."""
    rng = np.random.default_rng(0)
    n = mib * 2**20 // 4 // arrays
    return {f"w{i:04d}": rng.standard_normal(n, np.float32) for i in range(arrays)}


def solo(client: Client, state: dict[str, np.ndarray], first: int, reps: int) -> float:
    """Median handoff-to-LOCAL of a save made alone (the disk's time for one save)."""
    took = []
    for i in range(reps):
        t0 = time.perf_counter()
        client.save(first + i, state).wait("local", timeout=600)
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


def burst(client: Client, state: dict[str, np.ndarray], first: int, saves: int) -> dict[str, Any]:
    """``saves`` saves back to back; when each was acknowledged and reached LOCAL."""
    acked: list[float] = []
    local: list[float] = [0.0] * saves
    waiters = []
    t0 = time.perf_counter()
    for i in range(saves):
        handle = client.save(first + i, state)
        acked.append(time.perf_counter() - t0)

        def wait(i: int = i, handle: Any = handle) -> None:
            handle.wait("local", timeout=600)
            local[i] = time.perf_counter() - t0

        th = threading.Thread(target=wait, daemon=True)
        th.start()
        waiters.append(th)
    for th in waiters:
        th.join()
    return {"acked": acked, "local": local}


def model(acked: list[float], write: float) -> list[float]:
    """When each save reaches LOCAL if saves are written one at a time, in order."""
    out: list[float] = []
    for a in acked:
        out.append(max(a, out[-1] if out else 0.0) + write)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=128, help="size of one save (MiB)")
    p.add_argument("--arrays", type=int, default=64, help="arrays per save")
    p.add_argument("--saves", type=int, default=16, help="saves per burst")
    p.add_argument("--budget", type=int, default=4, help="staging budget, in saves")
    p.add_argument("--reps", type=int, default=3, help="bursts (and solo saves)")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch directory")
    args = p.parse_args()
    state = state_of(args.mib, args.arrays)
    budget = f"{args.budget * (args.mib + 1)}MiB"
    runs = []
    with run_directory(args.dir, "overload") as run:
        daemon = Daemon(
            run / "root",
            staging_budget=budget,
            # Every save written, in order: the queue this measures (by default a newer
            # save takes the place of one not yet written: bench_every_step.py).
            extra_args=["--retention-local", "KeepLatest(2)", "--no-supersede-unwritten"],
        )
        daemon.start()
        try:
            client = Client("overload", socket=daemon.socket)
            step = 0
            client.save(step, state).wait("local", timeout=600)  # warm segments and spares
            step += 1
            for _ in range(args.reps):
                write = solo(client, state, step, 3)
                step += 3
                b = burst(client, state, step, args.saves)
                # The order steps became LOCAL, from the daemon's events (the waiter
                # threads' clocks cannot order two steps committed a moment apart).
                done = [
                    e.step
                    for e in daemon.events("overload", after=0)
                    if e.kind == pb.STEP_EVENT_LOCAL and step <= e.step < step + args.saves
                ]
                step += args.saves
                runs.append({"write": write, "local_order": done, **b})
            client.close()
        finally:
            daemon.stop()
    rows, ratios, totals, late = [], [], [], 0
    for r in runs:
        want = model(r["acked"], r["write"])
        lat = [lo - a for lo, a in zip(r["local"], r["acked"], strict=True)]
        explained = [w - a for w, a in zip(want, r["acked"], strict=True)]
        ratios += [x / e for x, e in zip(lat, explained, strict=True)]
        totals.append(r["local"][-1] / (args.saves * r["write"]))
        assert len(r["local_order"]) == args.saves, r["local_order"]
        late += sum(
            1 for a, b in zip(r["local_order"], r["local_order"][1:], strict=False) if b < a
        )
    last = runs[-1]
    want = model(last["acked"], last["write"])
    for i in range(args.saves):
        rows.append(
            [
                i,
                f"{last['acked'][i] * 1e3:.0f}",
                f"{last['local'][i] * 1e3:.0f}",
                f"{want[i] * 1e3:.0f}",
                f"{(last['local'][i] - last['acked'][i]) / (want[i] - last['acked'][i]):.2f}",
            ]
        )
    print_table(
        ["save", "acked ms", "LOCAL ms", "model ms", "latency / model"],
        rows,
        f"last burst: {args.saves} saves of {args.mib} MiB, budget {args.budget} saves, "
        f"one save alone {last['write'] * 1e3:.0f} ms",
    )
    summary = {
        "latency_over_model_median": statistics.median(ratios),
        "latency_over_model_max": max(ratios),
        "burst_over_saves_x_write_median": statistics.median(totals),
        "out_of_order": late,
        "saves": args.saves * len(runs),
    }
    print(
        "latency / model: median {latency_over_model_median:.2f}, max "
        "{latency_over_model_max:.2f}; burst / (saves x W): {burst_over_saves_x_write_median:.2f};"
        " LOCAL out of ack order: {out_of_order} of {saves}".format(**summary)
    )
    write_results(
        "overload",
        {"args": vars(args) | {"dir": str(args.dir)}, "summary": summary, "runs": runs},
    )


if __name__ == "__main__":
    main()
