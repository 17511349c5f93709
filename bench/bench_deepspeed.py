"""DeepSpeed's ``save_checkpoint``: the time a trainer is blocked, with ckptd's checkpoint
engine against DeepSpeed's own engines, on the same model and the same disk.

One process (world size 1, gloo, CPU), three DeepSpeed engines built from the same
seeded model (an MLP of ``--layers`` square ``--width`` layers, ZeRO stage 2, AdamW),
each saving to its own directory on the same disk:

- **ckptd**: ``ckptd.client.deepspeed.use(engine, job)`` on a real ``ckptd serve``
  (local tier only, ``KeepLatest(2)``);
- **DeepSpeed**: its default ``TorchCheckpointEngine`` (``torch.save`` of each file);
- with ``--decoupled``, **DeepSpeed decoupled**: its asynchronous engine
  (``"checkpoint": {"writer": {"type": "python", "decoupled": true, "data_parallel":
  "replica"}}``): a writer process is handed the files, and the next
  ``engine.step()`` waits for it. On CPU it fails in DeepSpeed 0.19.8 with ZeRO-2
  (its queue refuses the optimizer's non-leaf fp32 partitions), so it is off by
  default; it is DeepSpeed's own asynchronous path on GPUs.

Per save, after one training step: the seconds ``save_checkpoint`` blocks, and the
seconds the next training step takes beyond a step without a save before it (the
decoupled engine commits there). Their sum is the trainer's cost. For ckptd, also
the time until the step is LOCAL (written, fsynced and renamed). The arms are
interleaved, the order rotating each repetition; medians of ``--reps`` after one
warm-up. A table on stdout and ``bench/results/deepspeed.json``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from common import (
    DEFAULT_WORK_DIR,
    Daemon,
    print_table,
    run_directory,
    settle,
    summarize,
    write_results,
)

JOB = "bench-deepspeed"
ARMS = ("ckptd", "deepspeed")
"""The arms run by default; ``--decoupled`` adds ``decoupled``."""
LABELS = {
    "ckptd": "ckptd",
    "deepspeed": "DeepSpeed (torch.save)",
    "decoupled": "DeepSpeed decoupled",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8, help="linear layers (default 8)")
    p.add_argument("--width", type=int, default=2048, help="layer width (default 2048)")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions (default 5)")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch dir (same disk)")
    p.add_argument("--name", default="deepspeed", help="results file bench/results/NAME.json")
    p.add_argument("--decoupled", action="store_true", help="add DeepSpeed's decoupled engine")
    args = p.parse_args(argv)
    args.arms = (*ARMS, "decoupled") if args.decoupled else ARMS
    if min(args.layers, args.width, args.reps) < 1:
        p.error("--layers, --width and --reps must be positive")
    return args


def make_engine(args: argparse.Namespace, arm: str) -> Any:
    """A DeepSpeed engine of the seeded model (the same weights for every arm)."""
    import deepspeed
    import torch

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
    }
    if arm == "decoupled":
        config["checkpoint"] = {
            "writer": {"type": "python", "decoupled": True, "data_parallel": "replica"}
        }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def train_step(engine: Any, width: int) -> float:
    """One training step on random data; its seconds."""
    import torch

    t0 = time.perf_counter()
    loss = engine(torch.randn(8, width)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - t0


def run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """All repetitions; returns the samples per measurement."""
    import deepspeed

    from ckptd.client import deepspeed as ckptd_deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        CROSS_RANK="0",
        CROSS_SIZE="1",
    )  # fmt: skip  (the deepspeed launcher's)
    deepspeed.init_distributed(dist_backend="gloo")
    samples: dict[str, list[float]] = {
        f"{arm}_{k}": [] for arm in args.arms for k in ("save", "next_step", "cost")
    }
    samples["ckptd_local"] = []
    with Daemon(
        run_dir / "ckptd-root",
        run_dir / "ckptd.sock",
        extra_args=["--retention-local", "KeepLatest(2)"],
    ) as daemon:
        engines = {arm: make_engine(args, arm) for arm in args.arms}
        ours = ckptd_deepspeed.use(engines["ckptd"], JOB, socket=daemon.socket)
        try:
            repeat(args, run_dir, engines, ours, samples)
        finally:  # its writer process, which a failed run would leave behind
            if "decoupled" in engines:
                engines["decoupled"].checkpoint_engine.cleanup()
        folder = run_dir / "deepspeed"
        tag = (folder / "latest").read_text().strip()
        nbytes = sum(f.stat().st_size for f in (folder / tag).iterdir())
    return {"samples": samples, "nbytes": nbytes}


def repeat(
    args: argparse.Namespace,
    run_dir: Path,
    engines: dict[str, Any],
    ours: Any,
    samples: dict[str, list[float]],
) -> None:
    """The warm-up and ``--reps`` repetitions, every arm in each."""
    for i in range(args.reps + 1):  # the first is a warm-up, not recorded
        n = i % len(args.arms)
        order = args.arms[n:] + args.arms[:n]
        row: dict[str, float] = {}
        for arm in order:
            engine = engines[arm]
            plain = statistics.median(train_step(engine, args.width) for _ in range(3))
            settle()
            t0 = time.perf_counter()
            engine.save_checkpoint(str(run_dir / arm))
            row[f"{arm}_save"] = time.perf_counter() - t0
            extra = max(train_step(engine, args.width) - plain, 0.0)
            if arm == "ckptd":  # the daemon wrote while the step ran
                ours.client.wait_until_finished("local", 600)
                row["ckptd_local"] = time.perf_counter() - t0
            row[f"{arm}_next_step"] = extra
            row[f"{arm}_cost"] = row[f"{arm}_save"] + extra
        if i > 0:
            for k, v in row.items():
                samples[k].append(v)
        print(
            f"rep {i}{'' if i else ' (warm-up)'}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in row.items()),
            flush=True,
        )


def report(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Print the table; returns the JSON document."""
    s = {k: summarize(v) for k, v in result["samples"].items()}

    def med(k: str) -> float:
        return float(s[k]["median"])

    rows = [
        [label, *(f"{med(f'{arm}_{k}'):.3f}" for arm in args.arms)]
        for label, k in (
            ("save_checkpoint blocks", "save"),
            ("next step's extra time", "next_step"),
            ("trainer's cost (sum)", "cost"),
        )
    ]
    rows.append(
        ["cost / ckptd's", *(f"{med(f'{a}_cost') / med('ckptd_cost'):.2f}x" for a in args.arms)]
    )
    mib = result["nbytes"] / 2**20
    print_table(
        ["median seconds", *(LABELS[a] for a in args.arms)],
        rows,
        title=f"DeepSpeed ZeRO-2 checkpoint of {mib:.0f} MiB, {args.reps} reps",
    )
    print(f"ckptd: save_checkpoint -> LOCAL on disk {med('ckptd_local'):.3f} s")
    return {
        "config": {k: str(v) for k, v in vars(args).items()},
        "arms": list(args.arms),
        "nbytes": result["nbytes"],
        "summary": s,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success."""
    args = parse_args(argv)
    with run_directory(args.dir, "deepspeed") as run_dir:
        result = run(args, run_dir)
    doc = report(result, args)
    path = write_results(args.name, doc, args.dir)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
