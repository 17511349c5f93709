"""The goodput benchmark's PyTorch job (bench/goodput/run.py ``--framework torch``).

The same model and events as job.py, in PyTorch: an MLP of ``--state-mib``
(parameters plus AdamW's two moments), data a function of the step number only,
the RNG state and the step saved with it, so the loss at step ``s`` is the same
bits however the run was interrupted. Saves are ``dcp.async_save`` with the
thread executor, one in flight at a time (torchtitan's pattern):

- ``ckptd-goodput`` / ``ckptd-learned`` / ``ckptd-continuous``: through ckptd's
  ``CkptdWriter`` (the state staged straight into the daemon's shared memory),
  when ``Client.should_save`` says so (``Goodput(mtbf_seconds=--mtbf)`` /
  ``Goodput()`` / ``Continuous()``); restored with ``dcp.load`` through
  ``CkptdReader``;
- ``dcp-interval``: DCP's ``FileSystemWriter(sync_files=True)`` every
  ``--interval-steps`` steps into ``--dir/step-N``, the newest two kept; restored
  from the newest directory whose ``.metadata`` (written last) exists;
- ``noop``: never saves.
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

from job import log


def free_port() -> int:
    """A TCP port nobody listens on now (the gloo group of one needs one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Trainer:
    """Model, optimizer and the step: a DCP ``Stateful``."""

    def __init__(self, state_mib: int, seed: int) -> None:
        import torch

        self.torch = torch
        torch.manual_seed(seed)
        self.width = 1024
        layers = max(1, round(state_mib * 2**20 / (3 * 4 * self.width * self.width)))
        self.model = torch.nn.Sequential(
            *(torch.nn.Linear(self.width, self.width, bias=False) for _ in range(layers))
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.seed, self.step = seed, 0

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim, "step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )
        self.step = int(sd["step"])

    def train_step(self) -> Any:
        torch = self.torch
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step)
        x = torch.randn(256, self.width, generator=g)
        h = x
        for layer in self.model:
            h = torch.tanh(layer(h))
        loss = torch.mean((h - torch.sin(x)) ** 2)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.step += 1
        return loss


def newest_dcp(root: Path) -> Path | None:
    """The newest complete FileSystemWriter checkpoint under ``root``."""
    done = [p for p in root.glob("step-*") if (p / ".metadata").exists()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def main() -> int:
    """Restore, then train until killed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", required=True, help="ckptd-goodput, ckptd-continuous, ...")
    ap.add_argument("--progress", type=Path, required=True, help="the event file")
    ap.add_argument("--socket", default=None, help="the ckptd daemon's socket")
    ap.add_argument("--job", default="goodput-torch", help="the ckptd job name")
    ap.add_argument("--dir", type=Path, default=None, help="FileSystemWriter's directory")
    ap.add_argument("--mtbf", type=float, default=60.0, help="Goodput()'s mtbf_seconds")
    ap.add_argument("--node-mtbf", type=float, default=None, help="(JAX job only)")
    ap.add_argument("--interval-steps", type=int, default=10, help="dcp-interval's period")
    ap.add_argument("--state-mib", type=int, default=256, help="parameters + AdamW moments")
    ap.add_argument("--seed", type=int, default=0, help="model and data seed")
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this step")
    args = ap.parse_args()
    out = args.progress.open("a")
    log(out, "start", time.time())
    import numpy as np
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    trainer = Trainer(args.state_mib, args.seed)
    state = {"train": trainer}
    client: Any = None
    if args.arm.startswith("ckptd"):
        from ckptd.client import Client, Continuous, Goodput, SavePolicy
        from ckptd.client.torch import CkptdReader, CkptdWriter

        policy: SavePolicy = Continuous()
        if args.arm == "ckptd-goodput":
            policy = Goodput(mtbf_seconds=args.mtbf)
        elif args.arm == "ckptd-learned":
            policy = Goodput()  # the failure rate learned from the daemon's record
        client = Client(args.job, socket=args.socket, policy=policy, timeout=600.0)
        if client.latest_step() is not None:
            dcp.load(state, storage_reader=CkptdReader(client))
    elif args.arm == "dcp-interval":
        args.dir.mkdir(parents=True, exist_ok=True)
        found = newest_dcp(args.dir)
        if found is not None:
            dcp.load(state, storage_reader=dcp.FileSystemReader(found))
    log(out, "restored", trainer.step, time.time())
    saving: Any = None
    while args.max_steps is None or trainer.step < args.max_steps:
        loss = trainer.train_step()
        step = trainer.step
        bits = np.asarray(loss.detach().numpy(), np.float32).view(np.uint32)
        log(out, "step", step, time.time(), f"{int(bits):08x}")
        if client is not None:
            if not client.should_save(step):
                continue
            if saving is not None:
                saving.result()  # one save in flight at a time
            saving = dcp.async_save(state, storage_writer=CkptdWriter(client, wait=None),
                                    checkpoint_id=step)  # fmt: skip
        elif args.arm == "dcp-interval" and step % args.interval_steps == 0:
            if saving is not None:
                saving.result()
                for old in sorted(args.dir.glob("step-*"), key=lambda p: int(p.name[5:]))[:-1]:
                    shutil.rmtree(old, ignore_errors=True)  # keep the newest two
            where = args.dir / f"step-{step}"
            saving = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(where,
                                    sync_files=True))  # fmt: skip
        else:
            continue
        log(out, "saved", step, time.time())
        policy = getattr(client, "policy", None)
        if getattr(policy, "save_cost_seconds", None) is not None:
            log(out, "policy", policy.interval_seconds, policy.save_cost_seconds,
                policy.base_step_seconds, policy.mtbf_estimate_seconds)  # fmt: skip
    if saving is not None:
        saving.result()
    return 0


if __name__ == "__main__":
    sys.exit(main())
