"""Lightning checkpoints through ckptd against Lightning's own writers, in one run on
the same model state.

A LightningModule of ``--params-mib`` float32 parameters (default 256 MiB, in 4
square linear layers) trained with Adam: the checkpoint holds the parameters and
both Adam moments (~3x, 768 MiB by default) plus Lightning's loops and callbacks.
Each repetition runs one short ``Trainer.fit`` per arm, arms interleaved in a
rotating order; at the second training step a callback calls
``trainer.save_checkpoint`` (what ``ModelCheckpoint`` calls) and times it:

- ``torch``: Lightning's default ``TorchCheckpointIO`` (``torch.save`` into the run
  directory, on the disk the daemon's root is on); its LOCAL-equivalent adds an
  ``fsync`` of the file (Lightning does not sync; ckptd's LOCAL is fsynced);
- ``torch-async``: ``AsyncCheckpointIO(TorchCheckpointIO)``: Lightning clones every
  tensor on the trainer's thread, then writes (and here fsyncs) on its own thread;
- ``ckptd``: ``CkptdCheckpointIO``: returns once the step is LOCAL;
- ``ckptd-async``: ``CkptdAsyncCheckpointIO``: returns once the tensors are copied
  into the daemon's shared memory (no clone); LOCAL from the daemon's LOCAL event;
- ``none``: no save (the steps after it, undisturbed: the baseline of ``next_steps``).

Per arm: ``save`` (the time the trainer is blocked in ``save_checkpoint``, Lightning
building the checkpoint dict included), ``local`` (until the checkpoint is on the
disk, fsynced: the file or ckptd's LOCAL), and ``next_steps`` (the three training
steps after the save, where a background writer competes with the trainer).
Medians over ``--reps``. A table on stdout and ``bench/results/lightning.json``.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
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

warnings.filterwarnings("ignore")

ARMS = ("none", "torch", "torch-async", "ckptd", "ckptd-async")
JOB = "bench-lightning"
"""Job name prefix: each repetition of each ckptd arm saves its own job's step."""
SAVE_AT = 2
"""The training step whose end saves (after Adam's moments exist)."""
AFTER = 3
"""Training steps timed after the save."""


def build(params_mib: int) -> Any:
    """The LightningModule class (imported here: ``--help`` needs no torch)."""
    import lightning.pytorch as L
    import torch

    width = 4096
    layers = max(1, params_mib * 2**20 // (4 * width * width))

    class Big(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.ModuleList(
                torch.nn.Linear(width, width, bias=False) for _ in range(layers)
            )

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x = torch.ones(1, width)
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x.square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(range(SAVE_AT + AFTER), batch_size=1)

    return Big


class Timer:
    """A callback: saves at step ``SAVE_AT`` through the trainer, times the steps after."""

    def __init__(self, path: str) -> None:
        import lightning.pytorch as L

        outer = self

        class _Cb(L.Callback):
            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                now = time.perf_counter()
                if trainer.global_step == SAVE_AT and outer.path:
                    outer.start_wall = time.time()
                    t0 = time.perf_counter()
                    trainer.save_checkpoint(outer.path)
                    outer.save = time.perf_counter() - t0
                    now = time.perf_counter()
                elif trainer.global_step > SAVE_AT:
                    outer.steps.append(now - outer.last)
                outer.last = now

        self.path = path
        self.callback = _Cb()
        self.start_wall = 0.0
        self.save = 0.0
        self.last = 0.0
        self.steps: list[float] = []


def fsynced_torch_io() -> Any:
    """``TorchCheckpointIO`` that fsyncs its file afterwards and notes when each part ended."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class Io(TorchCheckpointIO):
        written = synced = 0.0

        def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            super().save_checkpoint(checkpoint, path, storage_options)
            self.written = time.time()
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self.synced = time.time()

    return Io()


def one(arm: str, model_cls: Any, daemon: Daemon, run: Path, job: str) -> dict[str, float]:
    """One fit of ``arm``: its save, LOCAL and the steps after (seconds)."""
    import lightning.pytorch as L
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from ckptd.client.lightning import CkptdAsyncCheckpointIO, CkptdCheckpointIO
    from ckptd.proto import ckptd_pb2 as pb

    torch_io = fsynced_torch_io()
    plugin: Any = {
        "none": torch_io,
        "torch": torch_io,
        "torch-async": AsyncCheckpointIO(torch_io),
        "ckptd": CkptdCheckpointIO(job, daemon.socket),
        "ckptd-async": CkptdAsyncCheckpointIO(job, daemon.socket),
    }[arm]
    name = f"ckptd://{job}/step.ckpt" if arm.startswith("ckptd") else str(run / f"{arm}.ckpt")
    if arm == "none":
        name = ""
    timer = Timer(name)
    model = model_cls()
    trainer = L.Trainer(
        max_steps=SAVE_AT + AFTER,
        accelerator="cpu",
        plugins=[plugin],
        callbacks=[timer.callback],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    teardown_done = time.time()
    if arm == "none":
        local = save = 0.0
    elif arm == "torch":
        local = torch_io.synced - timer.start_wall
        save = torch_io.written - timer.start_wall  # what the trainer waits for without fsync
    elif arm == "torch-async":
        local, save = torch_io.synced - timer.start_wall, timer.save
    elif arm == "ckptd":
        local = save = timer.save
    else:
        at = daemon.event_time(job, SAVE_AT, pb.STEP_EVENT_LOCAL)
        local, save = (at or teardown_done) - timer.start_wall, timer.save
    if arm.startswith("ckptd"):
        plugin.store.close()
    elif name:
        Path(name).unlink(missing_ok=True)
    return {"save": save, "local": local, "next_steps": sum(timer.steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--params-mib", type=int, default=256, help="parameters (x3 with Adam)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR)
    a = p.parse_args()
    arms = [x for x in a.arms.split(",") if x]
    model_cls = build(a.params_mib)
    load_start = os.getloadavg()
    samples: dict[str, dict[str, list[float]]] = {
        arm: {"save": [], "local": [], "next_steps": []} for arm in arms
    }
    with run_directory(a.dir, "lightning") as run:
        daemon = Daemon(run / "root", staging_budget="4GiB", log_path=run / "daemon.log")
        daemon.start()
        try:
            for rep in range(a.reps):
                order = arms[rep % len(arms) :] + arms[: rep % len(arms)]
                for arm in order:
                    settle()
                    got = one(arm, model_cls, daemon, run, f"{JOB}-{rep}-{arm}")
                    for k, v in got.items():
                        samples[arm][k].append(v)
                    print(f"rep {rep} {arm}: {got}", flush=True)
        finally:
            daemon.stop()
    summary = {arm: {k: summarize(v) for k, v in s.items()} for arm, s in samples.items()}
    rows = [
        [arm, s["save"]["median"], s["local"]["median"], s["next_steps"]["median"]]
        for arm, s in summary.items()
    ]
    state_mib = 3 * a.params_mib
    title = f"Lightning save of a ~{state_mib} MiB checkpoint (medians of {a.reps}, seconds)"
    print_table(
        ["arm", "save (trainer blocked)", "to LOCAL (fsynced)", "3 steps after"], rows, title
    )
    config = {
        "params_mib": a.params_mib,
        "state_mib": state_mib,
        "reps": a.reps,
        "arms": arms,
        "loadavg_start_end": [load_start, os.getloadavg()],
    }
    write_results("lightning", {"config": config, "arms": summary}, a.dir)


if __name__ == "__main__":
    main()
