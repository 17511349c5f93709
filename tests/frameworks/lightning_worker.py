"""A tiny Lightning training run through ckptd, for tests/frameworks/test_lightning.py.

In-process (``fit(...)``) or as a script: ``python lightning_worker.py --socket S
--job J --out OUT.pt [--ckpt-path last] [--kill-at STEP --marker FILE] [--devices 2]``.

The model (two linear layers around a BatchNorm, whose running statistics are
buffers) trains with Adam and a per-step StepLR on data made from the global step
(and the rank), so a run resumed from any step sees the batches the uninterrupted
run saw, and nothing draws from the global RNG (which Lightning does not save).
At the end the output file holds the weights, buffers and optimizer state, the
step training started from, and the rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*isinstance.*LeafSpec.*")
warnings.filterwarnings("ignore", ".*litlogger.*")

import lightning.pytorch as L  # noqa: E402

from ckptd.client.lightning import (  # noqa: E402
    CkptdAsyncCheckpointIO,
    CkptdCheckpointIO,
    CkptdModelCheckpoint,
)

BATCHES = 5
"""Batches per epoch: saves every 3 steps fall mid-epoch and at epoch ends."""


def publish(path: Path, text: str) -> None:
    """Write PATH whole or not at all: the test polls for it and reads it at once."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Tiny(L.LightningModule):
    """The model under test."""

    def __init__(self, lr: float = 0.05, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, width),
            torch.nn.BatchNorm1d(width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 1),
        )
        self.start_step = -1

    def on_train_start(self) -> None:
        self.start_step = self.trainer.global_step  # after any restore

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.trainer.global_step + self.global_rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(range(BATCHES), batch_size=1)


class KillingIO(CkptdAsyncCheckpointIO):
    """The real IO; after the save of ``kill_at`` under the last name returns, writes
    ``marker`` and waits there for the test's SIGKILL."""

    kill_at = -1
    marker = Path()

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        if checkpoint["global_step"] == self.kill_at and "last" in os.path.basename(path):
            publish(self.marker, str(self.kill_at))
            time.sleep(600)


def trainer(
    socket: str,
    job: str,
    max_steps: int,
    *,
    io: Any = None,
    devices: int = 1,
    every: int = 3,
    top_k: int = 2,
    monitor: str | None = "train_loss",
    save_last: bool = True,
) -> L.Trainer:
    """The Trainer every run uses (``io``: the CheckpointIO, default the async one)."""
    ckpt = CkptdModelCheckpoint(
        save_last=save_last,
        save_top_k=top_k,
        monitor=monitor,
        every_n_train_steps=every,
    )
    return L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        plugins=[io or CkptdAsyncCheckpointIO(job, socket)],
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )


def state_of(t: L.Trainer, model: Tiny) -> dict[str, Any]:
    """What a finished run is compared on."""
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": t.optimizers[0].state_dict(),
        "sched": t.lr_scheduler_configs[0].scheduler.state_dict(),
        "global_step": t.global_step,
        "start_step": model.start_step,
        "rank": t.global_rank,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=14)
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--marker", default="")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--sync", action="store_true", help="CkptdCheckpointIO (waits for LOCAL)")
    a = p.parse_args()
    io: Any
    if a.kill_at >= 0:
        io = KillingIO(a.job, a.socket)
        io.kill_at, io.marker = a.kill_at, Path(a.marker)
    else:
        io = (CkptdCheckpointIO if a.sync else CkptdAsyncCheckpointIO)(a.job, a.socket)
    model = Tiny()
    t = trainer(a.socket, a.job, a.max_steps, io=io, devices=a.devices)
    t.fit(model, ckpt_path=a.ckpt_path)
    out = Path(a.out)
    torch.save(state_of(t, model), out.with_name(f"{out.stem}.rank{t.global_rank}{out.suffix}"))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
