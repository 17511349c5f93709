"""Restart to restored after a trainer SIGKILL on a live node (the memory tier's goal).

A trainer process saves the state, is SIGKILLed once the save is done, and a new
trainer process restores it. Arms, on the same state in the same run, interleaved:

- ``ckptd-memory``: ``Client.save`` until LOCAL, a daemon with the memory tier on
  (``--memory-tier-steps 1``); the new trainer's ``Client.restore()``;
- ``ckptd-disk``: the same with the memory tier off (``--memory-tier-steps 0``):
  ckptd's cold restore;
- ``dlrover``: DLRover Flash Checkpoint (``DdpCheckpointer``) saving to memory,
  its agent's saver in a process of its own; the new trainer's ``load_checkpoint()``
  from shared memory (its own venv: ``make bench-dlrover``);
- ``dcp``: PyTorch DCP ``save`` to a directory, the new trainer's ``dcp.load``.

Every step's files are evicted from the page cache before the restart (the memory
tier and DLRover read none). Per restart: ``restore`` (the call until the state is
in hand), ``touched`` (that plus a read of every byte: lazy mapping is not hidden),
``restart`` (from the driver's spawn of the new process until touched). Goals:
ckptd-memory within 1.5x DLRover's memory restore and <= 0.2x ckptd-disk.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    DEFAULT_WORK_DIR,
    REPO_ROOT,
    Daemon,
    print_table,
    run_directory,
    summarize,
    write_results,
)
from restart_arms import (
    Arm,
    DlroverAgent,
    python_ok,
    this_python,
    tier_args,
    versions,
    write_image,
)
from transformer_arms import eight_array_state, leaves, transformer_state

ARMS = ("ckptd-memory", "ckptd-disk", "dlrover", "dcp")
STATES = ("8arrays", "transformer")
DLROVER_PYTHON = REPO_ROOT / ".venv-dlrover" / "bin" / "python"
GOALS = (("ckptd-memory", "dlrover", 1.5), ("ckptd-memory", "ckptd-disk", 0.2))


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (``--quick``: 0.25 GiB, 2 repetitions)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="size of each state (default 1)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (default 3)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"subset of {','.join(ARMS)}")
    p.add_argument("--states", help=f"subset of {','.join(STATES)} (default: both)")
    p.add_argument("--quick", action="store_true", help="0.25 GiB, 8arrays only, 2 repetitions")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch dir (bench disk)")
    p.add_argument("--dlrover-python", default=str(DLROVER_PYTHON), help="python with dlrover")
    args = p.parse_args(argv)
    if args.quick:
        args.gib, args.reps = 0.25, 2
    if args.states is None:  # --quick leaves out the transformer: DCP takes 30 s a rep on it
        args.states = "8arrays" if args.quick else ",".join(STATES)
    unknown = set(args.arms.split(",")) - set(ARMS) | set(args.states.split(",")) - set(STATES)
    if unknown:
        p.error(f"unknown arm or state {sorted(unknown)}: arms {ARMS}, states {STATES}")
    if args.reps < 1 or args.gib <= 0:
        p.error("--reps must be at least 1 and --gib positive")
    return args


def images(args: argparse.Namespace, run: Path) -> dict[str, dict[str, Any]]:
    """Build each state once and write it as ``<run>/<state>.img`` (+ layout)."""
    t0 = time.perf_counter()
    tstate, _shape = transformer_state(int(args.gib * 2**30), np.dtype(np.float32), 0)
    total = sum(a.nbytes for a in leaves(tstate))
    layouts = {}
    for name in args.states.split(","):
        state = tstate if name == "transformer" else eight_array_state(total, 1)
        layouts[name] = write_image(state, run / f"{name}.img")
        del state
    del tstate
    print(f"states written in {time.perf_counter() - t0:.1f} s ({total / 2**30:.3f} GiB each)")
    return layouts


def run(args: argparse.Namespace, run_dir: Path, notes: list[str]) -> dict[str, Any]:
    """Start the daemons, then per state: one warm-up and ``--reps`` rounds of every arm."""
    arms = args.arms.split(",")
    if "dlrover" in arms and (why := python_ok(args.dlrover_python, "dlrover")):
        notes.append(f"dlrover arm skipped ({why}): `make bench-dlrover` installs it")
        arms.remove("dlrover")
    if "dcp" in arms and (why := python_ok(this_python(), "torch.distributed.checkpoint")):
        notes.append(f"dcp arm skipped ({why}): `make bench-deps`")
        arms.remove("dcp")
    if not arms:
        raise SystemExit(f"bench_restart: no arm left to run: {'; '.join(notes)}")
    layouts = images(args, run_dir)
    base = ["--retention-local", "KeepLatest(2)"]
    daemons: dict[str, Daemon] = {}
    log = open(run_dir / "agents.log", "a")  # noqa: SIM115  (closed in the finally clause)
    agent: DlroverAgent | None = None
    samples: dict[str, dict[str, dict[str, list[float]]]] = {}
    warmup: dict[str, dict[str, dict[str, float]]] = {}
    load = [os.getloadavg()]
    try:
        for arm, steps in (("ckptd-memory", 1), ("ckptd-disk", 0)):
            if arm in arms:
                d = Daemon(
                    run_dir / f"root-{arm}",
                    run_dir / f"{arm}.sock",
                    staging_budget="3GiB",
                    extra_args=[*base, *tier_args(steps)],
                )
                daemons[arm] = d.start()
        for state in layouts:
            if "dlrover" in arms:
                agent = DlroverAgent(args.dlrover_python, f"ckptd-bench-{os.getpid()}-{state}", log)
            runners = {
                a: Arm(
                    a,
                    state,
                    run_dir,
                    args.dlrover_python if a == "dlrover" else this_python(),
                    daemon=daemons.get(a),
                    agent=agent if a == "dlrover" else None,
                )
                for a in arms
            }
            samples[state], warmup[state] = {a: {} for a in arms}, {}
            for rep in range(args.reps + 1):  # rep 0 warms leases, segments, page cache
                k = rep % len(arms)
                for a in arms[k:] + arms[:k]:
                    row = runners[a].rep(step=rep + 1)
                    if rep == 0:
                        warmup[state][a] = row
                    else:
                        for key, v in row.items():
                            samples[state][a].setdefault(key, []).append(v)
                    print(
                        f"rep {rep}{' (warm-up)' if rep == 0 else ''} {state} {a}: "
                        + ", ".join(f"{key} {v:.3f}" for key, v in row.items()),
                        flush=True,
                    )
            if agent is not None:
                agent.close()
                agent = None
    finally:
        if agent is not None:
            agent.close()
        log.close()
        for d in daemons.values():
            rc = d.stop()
            if rc not in (0, None):
                notes.append(f"ckptd serve exited with status {rc}")
    return {
        "samples": {
            s: {a: {k: summarize(v) for k, v in m.items()} for a, m in per.items()}
            for s, per in samples.items()
        },
        "warmup": warmup,
        "arrays": {s: len(layout["arrays"]) for s, layout in layouts.items()},
        "nbytes": {s: layout["nbytes"] for s, layout in layouts.items()},
        "arms": arms,
        "daemon_args": {a: d.args for a, d in daemons.items()},
        "versions": {
            "dlrover_venv": versions(args.dlrover_python, ("dlrover", "torch"))
            if "dlrover" in arms
            else {},
            "venv": versions(this_python(), ("torch", "numpy")),
        },
        "loadavg_start_end": [*load, os.getloadavg()],
    }


def med(res: dict[str, Any], state: str, arm: str, key: str) -> float | None:
    """The median of one arm's samples, None when the arm did not run."""
    m = res["samples"].get(state, {}).get(arm, {}).get(key)
    return m["median"] if m else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def report(res: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Print the table and the goals; returns the ratios and goals for the results."""
    rows, ratios, goals = [], {}, {}
    for state in res["samples"]:
        for arm in res["arms"]:
            r, t, s = (med(res, state, arm, k) for k in ("restore", "touched", "restart"))
            per = {
                f"{k}/{ref}": ratio(med(res, state, arm, k), med(res, state, ref, k))
                for ref in ("dlrover", "ckptd-disk")
                for k in ("restore", "touched")
            }
            ratios[f"{state}/{arm}"] = per
            rows.append(
                [
                    arm,
                    state,
                    r,
                    t,
                    s,
                    per["restore/dlrover"],
                    per["touched/dlrover"],
                    per["restore/ckptd-disk"],
                    per["touched/ckptd-disk"],
                ]
            )
    print_table(
        [
            "arm",
            "state",
            "restore s",
            "touched s",
            "restart s",
            "rst/dlrover",
            "tch/dlrover",
            "rst/disk",
            "tch/disk",
        ],
        rows,
        f"restart after SIGKILL, medians of {args.reps}, "
        + ", ".join(f"{s} {n / 2**30:.3f} GiB" for s, n in res["nbytes"].items()),
    )
    print("\nGoals (ratio of medians; 'touched' = restore + a read of every byte):")
    for state in res["samples"]:
        for arm, ref, limit in GOALS:
            for k in ("restore", "touched"):
                v = ratio(med(res, state, arm, k), med(res, state, ref, k))
                key = f"{state}: {arm} {k} / {ref} {k} <= {limit}"
                goals[key] = {"ratio": v, "limit": limit, "met": v is not None and v <= limit}
                verdict = "-" if v is None else ("met" if v <= limit else "NOT met")
                shown = "-" if v is None else f"{v:.2f}"
                print(f"  {key}: {shown} ({verdict})")
    return {"ratios": ratios, "goals": goals}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; write ``bench/results/restart.json``."""
    args = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally clauses run
    notes: list[str] = []
    with run_directory(args.dir, "restart") as run_dir:
        res = run(args, run_dir, notes)
    out = report(res, args)
    for n in notes:
        print(f"note: {n}")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path = write_results("restart", {"config": config, **res, **out, "notes": notes}, args.dir)
    print(f"\nresults: {path}")
    load = statistics.mean(x[0] for x in res["loadavg_start_end"])
    print(f"load average (1 min) at start and end, mean: {load:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
