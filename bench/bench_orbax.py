"""Orbax users: what ckptd's adoption adds to an Orbax save, in one run.

One 1 GiB JAX state on CPU, one disk. Each repetition saves it with the same
Orbax ``CheckpointManager`` options (async, ``max_to_keep=2``) twice:

- into a plain directory (Orbax alone: the peer);
- into the job's directory watched by a real ``ckptd serve`` with a ``file://``
  remote on the same disk, then measures how long after Orbax finished the
  daemon had the step LOCAL (adopted: hard links, fsync, one crc32c read of
  every file) and DURABLE (copied into the bucket, published whole).

Floors, in the same run: an fsync of every file plus reading every byte once and
computing its crc32c, on the plain directory's step right after Orbax finished
it (adoption must also fsync what Orbax left unsynced), and ``shutil.copytree``
plus fsync of the step (what the upload to a ``file://`` bucket must do at
least). A table on stdout and ``bench/results/orbax.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bench_jax import make_state
from common import (
    DEFAULT_WORK_DIR,
    Daemon,
    print_table,
    run_directory,
    settle,
    summarize,
    write_results,
)

JOB = "bench-orbax"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1)")
    p.add_argument("--arrays", type=int, default=8, help="number of arrays (default 8)")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions (default 5)")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch dir (same disk)")
    p.add_argument("--name", default="orbax", help="results file bench/results/NAME.json")
    args = p.parse_args(argv)
    args.devices, args.seed = 1, 0
    if args.size_gib <= 0 or args.arrays < 1 or args.reps < 1:
        p.error("--size-gib, --arrays and --reps must be positive")
    return args


def adopt_floor(step_dir: Path) -> float:
    """Seconds to fsync every file of a step Orbax just finished (Orbax does not fsync)
    and read it once for its crc32c: what adoption must do at least."""
    from ckptd.core.checksum import of_file as crc32c_file

    t0 = time.perf_counter()
    for p in step_dir.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            crc32c_file(p)
    return time.perf_counter() - t0


def copy_floor(step_dir: Path, dest: Path) -> float:
    """Seconds to copy a step's tree and fsync every file (a file:// upload's floor)."""
    t0 = time.perf_counter()
    shutil.copytree(step_dir, dest)
    for p in dest.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    took = time.perf_counter() - t0
    shutil.rmtree(dest)
    return took


def wait_state(client: Any, step: int, tier: str, timeout: float = 300.0) -> float:
    """Poll until ``step`` is in ``tier`` ("LOCAL" / "REMOTE"); returns perf_counter then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in client.list():
            if c.step == step and tier in c.tiers:
                return time.perf_counter()
        time.sleep(0.005)
    raise TimeoutError(f"step {step} not in {tier} after {timeout} s")


def run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """All repetitions; returns the samples per measurement."""
    import orbax.checkpoint as ocp

    from ckptd.client import Client
    from ckptd.client import orbax as ckptd_orbax

    state, host, _ = make_state(args)
    nbytes = sum(a.nbytes for a in host.values())
    print(f"state ready: {nbytes / 2**30:.2f} GiB")
    bucket = run_dir / "bucket"
    samples: dict[str, list[float]] = {
        k: [] for k in ("alone", "watched", "local", "durable", "adopt_floor", "copy_floor")
    }
    with Daemon(
        run_dir / "ckptd-root",
        run_dir / "ckptd.sock",
        extra_args=["--remote", f"file://{bucket}", "--retention-local", "KeepLatest(2)"],
    ) as daemon:
        client = Client(job=JOB, socket=str(daemon.socket))
        options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
        plain = ocp.CheckpointManager(run_dir / "orbax-alone", options=options)
        watched = ocp.CheckpointManager(ckptd_orbax.directory(client), options=options)
        args_ = ocp.args.StandardSave(state)
        for i in range(args.reps + 1):  # the first is a warm-up, not recorded
            record = i > 0
            settle()
            t0 = time.perf_counter()
            plain.save(i, args=args_)
            plain.wait_until_finished()
            alone = time.perf_counter() - t0
            floor_adopt = adopt_floor(Path(plain.directory) / str(i))
            settle()
            t0 = time.perf_counter()
            watched.save(i, args=args_)
            watched.wait_until_finished()
            t_done = time.perf_counter()
            t_local = wait_state(client, i, "LOCAL")
            t_durable = wait_state(client, i, "REMOTE")
            step_dir = Path(watched.directory) / str(i)
            settle()
            floor_copy = copy_floor(step_dir, run_dir / "copy-floor")
            row = {
                "alone": alone,
                "watched": t_done - t0,
                "local": t_local - t_done,
                "durable": t_durable - t_done,
                "adopt_floor": floor_adopt,
                "copy_floor": floor_copy,
            }
            if record:
                for k, v in row.items():
                    samples[k].append(v)
            print(
                f"rep {i}{'' if record else ' (warm-up)'}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in row.items()),
                flush=True,
            )
        plain.close()
        watched.close()
        client.close()
    return {"samples": samples, "nbytes": nbytes}


def report(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Print the table; returns the JSON document."""
    s = {k: summarize(v) for k, v in result["samples"].items()}

    def med(k: str) -> float:
        return float(s[k]["median"])

    rows = [
        ["Orbax save -> finished, plain dir", f"{med('alone'):.3f}", "(peer)", ""],
        [
            "Orbax save -> finished, dir ckptd watches",
            f"{med('watched'):.3f}",
            f"{med('alone'):.3f}",
            f"{med('watched') / med('alone'):.2f}x",
        ],
        [
            "Orbax finished -> ckptd LOCAL (adopted)",
            f"{med('local'):.3f}",
            f"{med('adopt_floor'):.3f}",
            f"{med('local') / med('adopt_floor'):.2f}x",
        ],
        [
            "Orbax finished -> ckptd DURABLE (file://)",
            f"{med('durable'):.3f}",
            f"{med('copy_floor'):.3f}",
            f"{med('durable') / med('copy_floor'):.2f}x",
        ],
    ]
    print_table(
        ["measurement (median s)", "value", "peer / floor", "ratio"],
        rows,
        title=f"Orbax + ckptd adoption, {result['nbytes'] / 2**30:.2f} GiB, {args.reps} reps",
    )
    print(
        "floors: LOCAL vs fsync + one crc32c read of every file of a step Orbax just finished "
        "(the plain one); DURABLE vs copytree + fsync of the same step. LOCAL includes the "
        "scan interval (adopt_poll_seconds 0.25)"
    )
    return {
        "benchmark": "orbax",
        "state_bytes": result["nbytes"],
        "reps": args.reps,
        "orbax_options": "CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)",
        "remote": "file:// on the same disk",
        "measurements": s,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.dir = args.dir.resolve()
    with run_directory(args.dir, "orbax") as run_dir:
        doc = report(run(args, run_dir), args)
        print(f"results: {write_results(args.name, doc, work_dir=args.dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
