"""torchtitan's checkpoint manager through ckptd against its own default, DCP's
FileSystemWriter, in one run on the same state.

The state is what torchtitan's ``CheckpointManager`` saves: model parts (a stack of
``Linear`` layers, ``--mib`` MiB of float32 parameters), torchtitan's
``OptimizersContainer`` (AdamW, its two moments filled by one step), its
``LRSchedulersContainer``, and the dataloader and train state (small ``Stateful``
objects). One process, a gloo process group of 1, one ``ckptd serve`` whose root is
on the same disk as DCP's folder. Arms, interleaved, ``--repeats`` saves each (a new
step every time):

- ``dcp sync`` / ``ckptd sync``: ``CheckpointManager.save`` (stock, folder a
  directory) and ``CkptdCheckpointManager.save`` (folder ``ckptd://<job>``,
  ``wait="local"``): the trainer is blocked until the files are fsynced / the step is
  LOCAL (fsynced and renamed on the node's disk);
- ``dcp async`` / ``ckptd async`` (``async_mode="async"``): ``blocked`` until
  ``save`` returns (DCP stages the state into new CPU memory; ckptd's writer copies
  it into the daemon's shared memory), ``to local`` until its save future is done;
- ``ckptd pinned`` (``async_mode="async_with_pinned_mem"``): ``blocked`` is ``save``
  plus torchtitan's wait for staging before the next optimizer step (the copy runs on
  a thread meanwhile; here nothing overlaps it). Stock torchtitan's pinned mode needs
  an accelerator (DCP's ``DefaultStager`` refuses to start on a CPU): not measured.

A table on stdout, medians, and ``bench/results/torchtitan.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
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

ARMS = ("dcp sync", "ckptd sync", "dcp async", "ckptd async", "ckptd pinned")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Counter:
    """The dataloader's and train state's stand-in: a small ``Stateful``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


def build_state(mib: int) -> tuple[Any, Any, Any]:
    """Model parts, torchtitan's optimizers and lr schedulers (moments filled)."""
    import torch
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    width = 1024
    layers = max(1, mib * 2**20 // (4 * width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizers = default_adamw().build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=100)
    model(torch.randn(4, width)).sum().backward()
    optimizers.step()
    return model, optimizers, schedulers


def make_manager(arm: str, run: Path, state: tuple[Any, Any, Any]) -> Any:
    from torchtitan.components.checkpoint import CheckpointManager

    from ckptd.client.torchtitan import CkptdCheckpointManager

    mode = {"sync": "disabled", "async": "async", "pinned": "async_with_pinned_mem"}
    storage, kind = arm.split()
    common: dict[str, Any] = {
        "enable": True,
        "initial_load_model_only": False,
        "interval": 1,
        "keep_latest_k": 0,
        "async_mode": mode[kind],
    }
    if storage == "dcp":
        config = CheckpointManager.Config(folder=str(run / f"dcp-{kind}"), **common)
    else:
        config = CkptdCheckpointManager.Config(folder=f"ckptd://titan-{kind}", **common)
    model, optimizers, schedulers = state
    return config.build(
        dataloader=Counter(),
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": Counter()},
        sd_adapter=None,
        base_folder="",
    )


def one_save(arm: str, manager: Any, step: int) -> tuple[float, float]:
    """(seconds the trainer was blocked, seconds until on the local disk)."""
    t0 = time.perf_counter()
    manager.save(curr_step=step)
    if arm.endswith("pinned"):
        manager.maybe_wait_for_staging()
    blocked = time.perf_counter() - t0
    if manager.save_future is not None:
        manager.maybe_wait_for_saving()
    return blocked, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="model parameters, MiB (x3 with Adam)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    args = p.parse_args()

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    with run_directory(args.work_dir, "titan") as run:
        daemon = Daemon(run / "root", log_path=run / "daemon.log").start()
        os.environ["CKPTD_SOCKET"] = str(daemon.socket)
        try:
            state = build_state(args.mib)
            state_bytes = sum(t.nbytes for t in state[0].state_dict().values()) * 3
            managers = {arm: make_manager(arm, run, state) for arm in ARMS}
            samples: dict[str, dict[str, list[float]]] = {
                a: {"blocked": [], "local": []} for a in ARMS
            }
            handoffs: dict[str, list[str]] = {}
            for rep in range(args.repeats + 1):  # the first round warms up, untimed
                for arm in ARMS:
                    settle()
                    blocked, local = one_save(arm, managers[arm], rep + 1)
                    if rep:
                        samples[arm]["blocked"].append(blocked)
                        samples[arm]["local"].append(local)
                        writer = getattr(managers[arm], "writer", None)
                        if writer is not None:  # how ckptd's writer handed the state off
                            handoffs.setdefault(arm, []).append(writer.handoff)
                    for old in run.glob(f"dcp-*/step-{rep}"):
                        shutil.rmtree(old)  # what keep_latest_k would do, off the clock
            for m in managers.values():
                m.close()
        finally:
            daemon.stop()
    dist.destroy_process_group()

    results = {a: {k: summarize(v) for k, v in s.items()} for a, s in samples.items()}
    rows = [[a, results[a]["blocked"]["median"], results[a]["local"]["median"]] for a in ARMS]
    print_table(
        ["arm", "blocked s", "to local s"],
        rows,
        f"torchtitan CheckpointManager.save, {state_bytes / 2**20:.0f} MiB state, "
        f"medians of {args.repeats}",
    )
    path = write_results(
        "torchtitan",
        {
            "state_bytes": state_bytes,
            "repeats": args.repeats,
            "arms": results,
            "ckptd_handoff": handoffs,
        },
        args.work_dir,
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
