"""PyTorch DCP through ckptd against DCP's own FileSystemWriter, in one run on the same states.

Two states of ``--gib`` (default 1) each, as torch CPU tensors: 8 equal float32
tensors, and a transformer's parameters plus Adam's two moments (~1,500 tensors
from 1.5 KiB biases and norms to the embedding; ``transformer_arms``). One
process, a gloo process group of 1 (DCP's process executor needs one), one
``ckptd serve``. For each state, executor (``thread``, ``process``) and storage
(``ckptd``: ``CkptdWriter(client, wait="local")`` on the trainer's one client, or
made from the job name for the process executor, which pickles it; ``dcp``:
``FileSystemWriter(dir, sync_files=True)``), interleaved repetitions of:

- ``return``: ``dcp.async_save`` until it returns (the trainer is blocked: DCP stages
  the state, or ckptd's writer copies it into the daemon's shared memory);
- ``local``: until its future is done: ckptd's step LOCAL (fsynced and renamed on the
  local disk), DCP's files written and fsynced;
- ``second``: with the thread executor, in a separate pair of saves, a second
  ``async_save`` issued right after the first returned: until it returns (how long a
  trainer that saves again soon is blocked);
- ``restore``: ``dcp.load`` of the step, cold (page cache dropped), into tensors
  allocated and touched once (a model's state dict), plus a read of every byte.

Goals (issue 15): ckptd's blocking <= DCP's; time to LOCAL <= 0.3x DCP's total;
restore <= 0.5x DCP's. A table on stdout and ``bench/results/torch.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    DEFAULT_WORK_DIR,
    Daemon,
    drop_caches,
    print_table,
    run_directory,
    settle,
    summarize,
    write_results,
)
from floors import touch
from transformer_arms import (
    check_equal,
    eight_array_state,
    leaves,
    numpy_of,
    param_dtype,
    transformer_state,
    tree_map,
)

JOB = "bench-torch"
EXECUTORS = ("thread", "process")
STORAGES = ("ckptd", "dcp")
GOALS = {"return": 1.0, "local": 0.3, "restore": 0.5}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Bench:
    """The states, the daemon and the process group of one run."""

    def __init__(self, args: argparse.Namespace, run: Path) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.args, self.run = torch, args, run
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        size = int(args.gib * 2**30)
        tf, _ = transformer_state(size, param_dtype(args.param_dtype), 0)
        total = sum(a.nbytes for a in leaves(tf))
        numpy_states = {"transformer": tf, "8tensors": eight_array_state(total, 1)}
        self.numpy = {k: v for k, v in numpy_states.items() if k in args.states.split(",")}
        self.tensors = {k: tree_map(self._tensor, v) for k, v in self.numpy.items()}
        self.targets = {
            k: tree_map(lambda t: torch.zeros_like(t), v) for k, v in self.tensors.items()
        }
        self.counts = {k: len(list(leaves(v))) for k, v in self.numpy.items()}
        self.nbytes = total
        self.daemon = Daemon(run / "root", extra_args=["--retention-local", "KeepLatest(2)"])
        self.daemon.start()
        from ckptd.client import Client

        self.client = Client(JOB, socket=self.daemon.socket)
        self.step = 0
        self.samples: dict[str, list[float]] = {}

    def _tensor(self, a: np.ndarray) -> Any:
        if a.dtype.name == "bfloat16":
            return self.torch.from_numpy(a.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(a)

    def close(self) -> None:
        import torch.distributed as dist

        self.client.close()
        self.daemon.stop()
        dist.destroy_process_group()

    def add(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    # -- one save ----------------------------------------------------------------------
    def writer(self, storage: str, where: Path, executor: str = "thread") -> tuple[Any, Any]:
        """A fresh storage writer and reader for one checkpoint. ckptd's writer uses the
        trainer's one client (as README's example does), except with the process
        executor, which needs a writer it can pickle: one made from the job name."""
        import torch.distributed.checkpoint as dcp

        from ckptd.client.torch import CkptdReader, CkptdWriter

        if storage == "ckptd":
            self.step += 1
            owner = JOB if executor == "process" else self.client
            w = CkptdWriter(owner, step=self.step, socket=str(self.daemon.socket), wait="local")
            return w, CkptdReader(self.client, step=self.step)
        return dcp.FileSystemWriter(where, sync_files=True), dcp.FileSystemReader(where)

    def save(self, name: str, storage: str, executor: str, rep: int) -> None:
        """One measured async_save to its end; with the thread executor, then a pair: a
        second async_save issued right after the first returned."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = (
            AsyncCheckpointerType.PROCESS if executor == "process" else AsyncCheckpointerType.THREAD
        )
        state = self.tensors[name]
        tag = f"{name}:{storage}:{executor}"
        where = self.run / f"dcp-{name}-{executor}-{rep}"
        writer, reader = self.writer(storage, where, executor)
        settle()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=writer, async_checkpointer_type=kind)
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        self.add(f"{tag}:return", t1 - t0)
        self.add(f"{tag}:local", t2 - t0)
        if executor == "thread":
            self.restore(name, storage, reader, where)
            self.pair(name, storage, kind, rep)
        _close(writer)
        _close(reader)
        shutil.rmtree(where, ignore_errors=True)

    def pair(self, name: str, storage: str, kind: Any, rep: int) -> None:
        """Two async_saves back to back: how long the second call blocks."""
        import torch.distributed.checkpoint as dcp

        state = self.tensors[name]
        dirs = [self.run / f"dcp-{name}-pair{i}-{rep}" for i in (1, 2)]
        w1, _ = self.writer(storage, dirs[0])
        w2, _ = self.writer(storage, dirs[1])
        settle()
        first = dcp.async_save(state, storage_writer=w1, async_checkpointer_type=kind)
        t0 = time.perf_counter()
        second = dcp.async_save(state, storage_writer=w2, async_checkpointer_type=kind)
        self.add(f"{name}:{storage}:thread:second", time.perf_counter() - t0)
        first.result()
        second.result()
        for w, d in zip((w1, w2), dirs, strict=True):
            _close(w)
            shutil.rmtree(d, ignore_errors=True)

    def restore(self, name: str, storage: str, reader: Any, where: Path) -> None:
        """dcp.load of the step just saved, cold, into the touched target; checked."""
        import torch.distributed.checkpoint as dcp

        target = self.targets[name]
        for t in leaves(target):
            t.zero_()  # untimed: a failed load cannot pass the check on old bytes
        drop_caches(self.daemon.root if storage == "ckptd" else where)
        settle()
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=reader)
        touch([numpy_of(t) for t in leaves(target)])
        self.add(f"{name}:{storage}:restore", time.perf_counter() - t0)
        check_equal(self.numpy[name], target, f"{storage} load")


def _close(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if close is not None:
        with contextlib.suppress(Exception):
            close()


def run_all(args: argparse.Namespace, run: Path) -> dict[str, Any]:
    bench = Bench(args, run)
    executors = [e for e in EXECUTORS if e in args.executors.split(",")]
    print(
        f"states {bench.counts}, {bench.nbytes / 2**30:.3f} GiB each; executors {executors}",
        flush=True,
    )
    warmup: dict[str, list[float]] = {}
    try:
        for rep in range(args.reps + 1):  # rep 0 warms leases, spare files, imports
            for name in bench.numpy if rep % 2 else reversed(list(bench.numpy)):
                for executor in executors if rep % 2 else list(reversed(executors)):
                    for storage in STORAGES if rep % 2 else list(reversed(STORAGES)):
                        bench.save(name, storage, executor, rep)
            if rep == 0:
                warmup, bench.samples = bench.samples, {}
            print(f"rep {rep} done", flush=True)
    finally:
        bench.close()
    return {"samples": bench.samples, "warmup": warmup, "counts": bench.counts}


def report(res: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    s = res["samples"]

    def med(key: str) -> float | None:
        return statistics.median(s[key]) if key in s else None

    rows, ratios = [], {}
    for name in res["counts"]:
        for executor in EXECUTORS:
            for metric in ("return", "second", "local"):
                c = med(f"{name}:ckptd:{executor}:{metric}")
                d = med(f"{name}:dcp:{executor}:{metric}")
                if c is None or d is None:
                    continue
                goal = {"return": 1.0, "second": 1.0, "local": 0.3}[metric]
                ratios[f"{name}:{executor}:{metric}"] = {"ckptd": c, "dcp": d, "ratio": c / d}
                rows.append(
                    [
                        name,
                        executor,
                        metric,
                        f"{c * 1e3:.0f}",
                        f"{d * 1e3:.0f}",
                        f"{c / d:.2f}x",
                        f"<= {goal}: {'met' if c / d <= goal else 'NOT met'}",
                    ]
                )
        c, d = med(f"{name}:ckptd:restore"), med(f"{name}:dcp:restore")
        if c is not None and d is not None:
            ratios[f"{name}:restore"] = {"ckptd": c, "dcp": d, "ratio": c / d}
            rows.append(
                [
                    name,
                    "-",
                    "restore",
                    f"{c * 1e3:.0f}",
                    f"{d * 1e3:.0f}",
                    f"{c / d:.2f}x",
                    f"<= 0.5: {'met' if c / d <= 0.5 else 'NOT met'}",
                ]
            )
    print_table(
        ["state", "executor", "measure", "ckptd ms", "DCP ms", "ratio", "goal"],
        rows,
        f"dcp.async_save / dcp.load through ckptd vs FileSystemWriter, medians of {args.reps}",
    )
    print("  return: async_save returns; second: a second async_save right after the first")
    print("  local: the future done (ckptd: LOCAL; DCP: files fsynced); restore: cold, touched")
    import torch

    return {
        "benchmark": "torch",
        "args": vars(args) | {"dir": str(args.dir)},
        "array_counts": res["counts"],
        "versions": {"torch": torch.__version__, "numpy": np.__version__},
        "measurements": {k: summarize(v) for k, v in s.items()},
        "warmup": res["warmup"],
        "ratios": ratios,
        "goals": GOALS,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (default 3)")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--states", default="8tensors,transformer")
    p.add_argument("--executors", default=",".join(EXECUTORS))
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch dir (same disk)")
    p.add_argument("--name", default="torch", help="results: bench/results/NAME.json")
    args = p.parse_args(argv)
    if args.gib <= 0 or args.reps < 1:
        p.error("--gib and --reps must be positive")
    warnings.filterwarnings("ignore", message=".*ComplexHalf.*")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.dir = args.dir.resolve()
    with run_directory(args.dir, "torch") as run:
        doc = report(run_all(args, run), args)
    print(f"results: {write_results(args.name, doc, work_dir=args.dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
