"""A tiny DeepSpeed training loop on CPU over gloo, as a user writes it, saving
through ckptd (tests/frameworks/test_deepspeed.py starts it as 2 processes).

``deepspeed_worker.py SOCKET JOB CKPT OUT [--stage S] [--steps N] [--every K]
[--kill-at K] [--plain]``: build the engine (ZeRO stage S, AdamW), call
``ckptd.client.deepspeed.use`` (not with ``--plain``: DeepSpeed's own
``torch.save`` engine), ``load_checkpoint(CKPT)``, then train to step N, saving
every K steps. ``--kill-at K``: SIGKILL this process right after step K's
``save_checkpoint`` returned. At the end write ``OUT.<rank>`` (JSON: the step
started from, the steps saved) and ``OUT.<rank>.pt`` (the model's parameters and the
optimizer's state as DeepSpeed holds them on this rank).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch


def publish(path: Path, text: str) -> None:
    """Write PATH whole or not at all: the test polls for it and reads it at once."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def batch(step: int, rank: int) -> torch.Tensor:
    """The data of one step on one rank: the same in every run."""
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 * step + rank))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("socket")
    p.add_argument("job")
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
        torch.nn.Linear(32, 4),
    )  # fmt: skip
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": a.stage},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    if not a.plain:
        from ckptd.client import deepspeed as ckptd_deepspeed

        ckptd_deepspeed.use(engine, a.job, socket=a.socket)
    loaded, _ = engine.load_checkpoint(a.ckpt)
    start = engine.global_steps if loaded else None
    saved = []
    while engine.global_steps < a.steps:
        step = engine.global_steps
        loss = engine(batch(step, rank)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if engine.global_steps % a.every == 0:
            engine.save_checkpoint(a.ckpt)
            saved.append(engine.global_steps)
            if engine.global_steps == a.kill_at:
                publish(Path(f"{a.out}.held{rank}"), json.dumps({"step": a.kill_at}))
                os.kill(os.getpid(), signal.SIGKILL)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    torch.save({"params": params, "optimizer": engine.optimizer.state_dict()}, f"{a.out}.{rank}.pt")
    publish(Path(f"{a.out}.{rank}"), json.dumps({"start": start, "saved": saved}))


if __name__ == "__main__":
    main()
