"""Hugging Face Trainer users: what the ckptd callback adds to a Trainer save, in one run.

One GPT-2 built from a config (default ~35 M parameters: the model, AdamW's two
moments and the Trainer's small files come to ~0.4 GiB per checkpoint), one
training step on CPU so the optimizer has its state, one disk. Each repetition
saves a ``checkpoint-N`` through the Trainer's own ``_save_checkpoint`` (what
``save_steps`` runs: model, optimizer, scheduler, RNG state, trainer state, then
``save_total_limit=2`` rotation) and its ``on_save`` callbacks, in two arms,
interleaved (their order alternates):

- HF alone (the peer): the Trainer's save with no ckptd callback. It returns with
  the bytes in the page cache, not on disk (the Trainer never fsyncs); to compare
  time to a locally durable copy, the same run also fsyncs every file of that
  checkpoint afterwards (``hf + fsync``).
- HF + ckptd: the same save, then ``CkptdCallback.on_save`` adopts the directory
  into a real ``ckptd serve`` (hard links, an fsync and one crc32c read of each
  file): LOCAL when it returns.

No bucket: the drain would compete with the next repetition for the disk. A table
on stdout and ``bench/results/hf.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
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

JOB = "bench-hf"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=6, help="GPT-2 layers (default 6)")
    p.add_argument("--n-embd", type=int, default=512, help="GPT-2 width (default 512)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions (default 5)")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch dir (same disk)")
    p.add_argument("--name", default="hf", help="results file bench/results/NAME.json")
    args = p.parse_args(argv)
    if min(args.n_layer, args.n_embd, args.vocab, args.reps) < 1:
        p.error("--n-layer, --n-embd, --vocab and --reps must be positive")
    return args


def fsync_tree(tree: Path) -> float:
    """Seconds to fsync every file of ``tree`` (what the Trainer leaves to the kernel)."""
    t0 = time.perf_counter()
    for p in tree.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return time.perf_counter() - t0


def tree_bytes(tree: Path) -> int:
    """Bytes in the files of ``tree``."""
    return sum(p.stat().st_size for p in tree.rglob("*") if p.is_file())


def make_trainer(args: argparse.Namespace, out: Path) -> Any:
    """A Trainer on the model, after one step (so AdamW holds its moments)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

    set_seed(0)
    config = GPT2Config(
        vocab_size=args.vocab, n_positions=64, n_embd=args.n_embd, n_layer=args.n_layer, n_head=8
    )
    ids = torch.randint(0, args.vocab, (8, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r} for r in ids]
    targs = TrainingArguments(
        output_dir=str(out),
        max_steps=1,
        save_strategy="no",  # the benchmark calls the Trainer's save itself
        save_total_limit=2,
        per_device_train_batch_size=2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=GPT2LMHeadModel(config), args=targs, train_dataset=data)
    trainer.train()
    return trainer


def save(trainer: Any, out: Path, step: int) -> tuple[float, float, Path]:
    """The Trainer's own save of ``step`` into ``out`` then its ``on_save`` callbacks, as
    ``save_steps`` runs them: seconds each took, and the checkpoint's directory."""
    trainer.args.output_dir = str(out)
    trainer.state.global_step = step
    t0 = time.perf_counter()
    trainer._save_checkpoint(trainer.model, trial=None)
    t1 = time.perf_counter()
    trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
    return t1 - t0, time.perf_counter() - t1, out / f"checkpoint-{step}"


def run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """All repetitions; returns the samples per measurement."""
    from ckptd.client import hf as ckptd_hf

    samples: dict[str, list[float]] = {
        k: [] for k in ("hf", "fsync", "hf_fsync", "ckptd", "hf_in_ckptd_arm", "adopt")
    }
    trainer = make_trainer(args, run_dir / "hf-alone")
    nbytes = 0
    with Daemon(
        run_dir / "ckptd-root",
        run_dir / "ckptd.sock",
        extra_args=["--retention-local", "KeepLatest(2)", "--adopt-dirs", str(run_dir)],
    ) as daemon:
        callback = ckptd_hf.CkptdCallback(JOB, socket=str(daemon.socket))
        for i in range(args.reps + 1):  # the first is a warm-up, not recorded
            row: dict[str, float] = {}
            for arm in ("hf", "ckptd") if i % 2 == 0 else ("ckptd", "hf"):
                step = 100 + 2 * i + (arm == "ckptd")
                settle()
                if arm == "hf":
                    took, hooks, tree = save(trainer, run_dir / "hf-alone", step)
                    row["hf"] = took + hooks
                    row["fsync"] = fsync_tree(tree)
                    row["hf_fsync"] = row["hf"] + row["fsync"]
                    nbytes = tree_bytes(tree)
                else:
                    trainer.add_callback(callback)
                    try:
                        took, hooks, _ = save(trainer, run_dir / "hf-ckptd", step)
                    finally:
                        trainer.remove_callback(callback)
                    row["ckptd"] = took + hooks
                    row["hf_in_ckptd_arm"] = took
                    row["adopt"] = hooks  # the callback's share: the adoption call
                    assert callback.last is not None and callback.last.step == step
            if i > 0:
                for k, v in row.items():
                    samples[k].append(v)
            print(
                f"rep {i}{'' if i else ' (warm-up)'}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in row.items()),
                flush=True,
            )
        adopted = sorted(c.step for c in callback.client.list() if c.adopted)
        callback.close()
    assert adopted, "nothing was adopted"
    return {"samples": samples, "nbytes": nbytes}


def report(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Print the table; returns the JSON document."""
    s = {k: summarize(v) for k, v in result["samples"].items()}

    def med(k: str) -> float:
        return float(s[k]["median"])

    rows = [
        ["HF save (Trainer sees), no ckptd", f"{med('hf'):.3f}", "(peer)", ""],
        [
            "HF save + ckptd callback (Trainer sees) = LOCAL",
            f"{med('ckptd'):.3f}",
            f"{med('hf'):.3f}",
            f"{med('ckptd') / med('hf'):.2f}x",
        ],
        [
            "  of which the ckptd callback (Adopt -> LOCAL)",
            f"{med('adopt'):.3f}",
            f"{med('fsync'):.3f}",
            f"{med('adopt') / med('fsync'):.2f}x",
        ],
        ["HF save, then fsync of its files (locally durable)", f"{med('hf_fsync'):.3f}", "", ""],
        [
            "HF + ckptd LOCAL vs HF + fsync",
            f"{med('ckptd'):.3f}",
            f"{med('hf_fsync'):.3f}",
            f"{med('ckptd') / med('hf_fsync'):.2f}x",
        ],
    ]
    print_table(
        ["measurement (median s)", "value", "peer / floor", "ratio"],
        rows,
        title=f"HF Trainer checkpoint, {result['nbytes'] / 2**30:.2f} GiB, {args.reps} reps",
    )
    print(
        "HF alone returns with its files in the page cache (the Trainer never fsyncs); the "
        "ckptd arm returns with them LOCAL: hard-linked, fsynced and checksummed. The "
        "callback's floor: an fsync of every file of the HF arm's checkpoint. A busy host "
        "makes the Trainer's own save vary most: compare the callback with its floor"
    )
    return {
        "benchmark": "hf",
        "checkpoint_bytes": result["nbytes"],
        "model": {"n_layer": args.n_layer, "n_embd": args.n_embd, "vocab": args.vocab},
        "reps": args.reps,
        "trainer": "transformers Trainer._save_checkpoint + on_save, save_total_limit=2, CPU",
        "remote": "none (no drain competing for the disk)",
        "measurements": s,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.dir = args.dir.resolve()
    with run_directory(args.dir, "hf") as run_dir:
        doc = report(run(args, run_dir), args)
        print(f"results: {write_results(args.name, doc, work_dir=args.dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
