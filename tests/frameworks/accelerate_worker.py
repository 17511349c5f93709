"""A tiny HF accelerate training loop on CPU, as a user writes it, its checkpoints
through ckptd (tests/frameworks/test_accelerate.py starts it as 2 processes).

``accelerate_worker.py SOCKET JOB PROJECT OUT [--steps N] [--every K] [--kill-at K]
[--total-limit L] [--plain]``: an ``Accelerator`` with automatic checkpoint naming
under PROJECT, a model, AdamW and a learning-rate schedule prepared, a step counter
registered for checkpointing; ``ckptd.client.accelerate.use`` (not with
``--plain``), ``load_state()``, then train to step N with ``save_state()`` every K
steps. ``--kill-at K``: SIGKILL this process right after step K's ``save_state``
returned. At the end write ``OUT.<rank>`` (JSON: the step started from, the steps
saved, the checkpoint folders) and ``OUT.<rank>.pt`` (parameters, optimizer and
schedule state).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration


def publish(path: Path, text: str) -> None:
    """Write PATH whole or not at all: the test polls for it and reads it at once."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Counter:
    """The training step, saved and loaded with the accelerator's state."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def batch(step: int, rank: int) -> torch.Tensor:
    """One step's data on one process, with noise from torch's RNG (restored by
    ``load_state``): the same in every run."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x + 0.01 * torch.randn(4, 16)


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("socket", "job", "project", "out"):
        p.add_argument(name)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--total-limit", type=int, default=None)
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()

    config = ProjectConfiguration(
        project_dir=a.project, automatic_checkpoint_naming=True, total_limit=a.total_limit
    )
    accelerator = Accelerator(cpu=True, project_config=config)
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    if not a.plain:
        from ckptd.client import accelerate as ckptd_accelerate

        ckptd_accelerate.use(accelerator, a.job, socket=a.socket)
        accelerator.load_state()
    start = counter.step if counter.step else None
    saved = []
    while counter.step < a.steps:
        loss = model(batch(counter.step, rank)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        counter.step += 1
        if counter.step % a.every == 0:
            accelerator.save_state()
            saved.append(counter.step)
            if counter.step == a.kill_at:
                publish(Path(f"{a.out}.held{rank}"), json.dumps({"step": a.kill_at}))
                os.kill(os.getpid(), signal.SIGKILL)
    unwrapped = accelerator.unwrap_model(model)
    torch.save(
        {
            "params": {n: t.detach().clone() for n, t in unwrapped.named_parameters()},
            "optimizer": optimizer.state_dict(),
            "schedule": schedule.state_dict(),
            "rng": torch.get_rng_state(),
        },
        f"{a.out}.{rank}.pt",
    )
    folders = sorted(os.listdir(Path(a.project, "checkpoints")))
    publish(
        Path(f"{a.out}.{rank}"), json.dumps({"start": start, "saved": saved, "folders": folders})
    )


if __name__ == "__main__":
    main()
