"""HF accelerate users: what ``ckptd.client.accelerate`` adds to ``save_state``, in one run.

One process, ``Accelerator(cpu=True)`` with automatic checkpoint naming and
``total_limit=2``, an MLP of ``--layers`` square ``--width`` layers trained one step
so AdamW has its state (~0.4 GiB per checkpoint with the defaults: the weights in
safetensors, the optimizer in ``optimizer.bin``, RNG states), one disk. Two
accelerators of the same seeded model, interleaved (the order alternates):

- **accelerate alone** (the peer): ``save_state()``. It returns with the bytes in
  the page cache, not on disk (accelerate never fsyncs); for the time to a locally
  durable copy the same run also fsyncs every file of the folder afterwards
  (``+ fsync``). accelerate has no asynchronous save.
- **accelerate + ckptd**: ``save_state()`` with ``ckptd.client.accelerate.use``:
  the same save, then a barrier and the adoption into a real ``ckptd serve`` (hard
  links, an fsync and one crc32c read of each file): LOCAL when it returns.

No bucket: the drain would compete with the next repetition for the disk. Medians
of ``--reps`` after one warm-up; a table on stdout and ``bench/results/accelerate.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    DEFAULT_WORK_DIR,
    Daemon,
    print_table,
    run_directory,
    settle,
    summarize,
    write_results,
)

JOB = "bench-accelerate"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8, help="linear layers (default 8)")
    p.add_argument("--width", type=int, default=2048, help="layer width (default 2048)")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions (default 5)")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch dir (same disk)")
    p.add_argument("--name", default="accelerate", help="results file bench/results/NAME.json")
    args = p.parse_args(argv)
    if min(args.layers, args.width, args.reps) < 1:
        p.error("--layers, --width and --reps must be positive")
    return args


def fsync_tree(tree: Path) -> float:
    """Seconds to fsync every file of ``tree`` (what accelerate leaves to the kernel)."""
    t0 = time.perf_counter()
    for f in sorted(p for p in tree.rglob("*") if p.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def make(args: argparse.Namespace, project: Path) -> tuple[Any, Any, Any]:
    """An accelerator, its prepared model and optimizer, one step trained."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, total_limit=2
    )
    accelerator = Accelerator(cpu=True, project_config=config)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    loss = model(torch.randn(8, args.width)).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    return accelerator, model, optimizer


def run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """All repetitions; returns the samples per measurement."""
    from ckptd.client import accelerate as ckptd_accelerate

    samples: dict[str, list[float]] = {k: [] for k in ("plain", "fsync", "plain_fsync", "ckptd")}
    nbytes = 0
    with Daemon(
        run_dir / "ckptd-root",
        run_dir / "ckptd.sock",
        extra_args=["--retention-local", "KeepLatest(2)", "--adopt-dirs", str(run_dir)],
    ) as daemon:
        plain, *_ = make(args, run_dir / "plain")
        ours, *_ = make(args, run_dir / "ckptd")
        ckptd_accelerate.use(ours, JOB, socket=daemon.socket)
        for i in range(args.reps + 1):  # the first is a warm-up, not recorded
            row: dict[str, float] = {}
            for arm in ("plain", "ckptd") if i % 2 == 0 else ("ckptd", "plain"):
                settle()
                acc = plain if arm == "plain" else ours
                t0 = time.perf_counter()
                folder = Path(acc.save_state())
                row[arm] = time.perf_counter() - t0
                if arm == "plain":
                    row["fsync"] = fsync_tree(folder)
                    row["plain_fsync"] = row["plain"] + row["fsync"]
                    nbytes = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            if i > 0:
                for k, v in row.items():
                    samples[k].append(v)
            print(
                f"rep {i}{'' if i else ' (warm-up)'}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in row.items()),
                flush=True,
            )
    return {"samples": samples, "nbytes": nbytes}


def report(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Print the table; returns the JSON document."""
    s = {k: summarize(v) for k, v in result["samples"].items()}

    def med(k: str) -> float:
        return float(s[k]["median"])

    rows = [
        ["save_state() (in the page cache)", f"{med('plain'):.3f}", ""],
        ["save_state(), then fsync of its files", f"{med('plain_fsync'):.3f}", ""],
        [
            "save_state() + ckptd's adoption (LOCAL)",
            f"{med('ckptd'):.3f}",
            f"{med('ckptd') / med('plain_fsync'):.2f}x save + fsync",
        ],
    ]
    print_table(
        ["median seconds", "", "against"],
        rows,
        title=f"accelerate save_state of {result['nbytes'] / 2**20:.0f} MiB, {args.reps} reps",
    )
    return {"config": {k: str(v) for k, v in vars(args).items()}, "nbytes": result["nbytes"],
            "summary": s}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success."""
    args = parse_args(argv)
    with run_directory(args.dir, "accelerate") as run_dir:
        result = run(args, run_dir)
    doc = report(result, args)
    print(f"results: {write_results(args.name, doc, args.dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
