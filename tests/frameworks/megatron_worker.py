"""Megatron-Core's own ``dist_checkpointing.save``/``load`` through ckptd's strategies
(run by test_megatron.py as 2 processes over gloo, CPU; not by pytest).

    python tests/frameworks/megatron_worker.py MODE SOCKET JOB CKPT_DIR OUT [KILL]

``save``: the sharded state of ``seed`` = the step saved synchronously through the
fully parallel save wrapper; ``async``: saved with ``async_sharded_save=True``,
then (``KILL``) SIGKILLed right after ``save`` returned the request, before its
finalize; ``load``: ``ensure_local`` then Megatron's ``load``, the state compared
with what ``seed`` saved. Each rank writes ``OUT.<rank>`` (a JSON line)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def publish(path: Path, text: str) -> None:
    """Write PATH whole or not at all: the test polls for it and reads it at once."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def state(step: int, rank: int, world: int, empty: bool = False) -> dict[str, Any]:
    """A small model's sharded state: a tensor split over the ranks, one replicated on
    every rank, an object per rank, and common values."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    gen = torch.Generator().manual_seed(step)
    split = torch.randn(world * 6, 4, generator=gen)
    shared = torch.randn(5, generator=gen)

    def value(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if empty else t

    return {
        "layer.weight": ShardedTensor.from_rank_offsets(
            "layer.weight", value(split[rank * 6 : (rank + 1) * 6].clone()), (0, rank, world)
        ),
        "norm.scale": ShardedTensor.from_rank_offsets(
            "norm.scale", value(shared.clone()), replica_id=rank
        ),
        "rng": ShardedObject(
            "rng", None if empty else {"rank": rank, "step": step}, (world,), (rank,), replica_id=0
        ),
        "iteration": step,
    }


def main() -> int:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    from ckptd.client import megatron as ckptd_megatron

    mode, socket, job, ckpt, out = sys.argv[1:6]
    kill = len(sys.argv) > 6
    os.environ["CKPTD_SOCKET"] = socket
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    step = ckptd_megatron.step_of(ckpt)
    save = FullyParallelSaveStrategyWrapper(ckptd_megatron.strategies(job))
    if rank == 0:
        Path(ckpt).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    seen: dict[str, Any] = {"rank": rank}
    if mode == "save":
        dist_checkpointing.save(state(step, rank, world), ckpt, sharded_strategy=save)
    elif mode == "async":
        request = dist_checkpointing.save(
            state(step, rank, world), ckpt, sharded_strategy=save, async_sharded_save=True
        )
        if kill:
            publish(Path(f"{out}.{rank}"), json.dumps({"rank": rank, "handed": True}))
            dist.barrier()  # every rank's tensors are in its daemon's memory
            os.kill(os.getpid(), signal.SIGKILL)
        request.execute_sync()  # what Megatron's async queue does: the finalize steps
    else:
        seen["wrote"] = ckptd_megatron.ensure_local(ckpt, job)
        dist.barrier()
        got = dist_checkpointing.load(state(step, rank, world, empty=True), ckpt)
        want = state(step, rank, world)
        seen["equal"] = all(
            torch.equal(got[k], want[k].data) for k in ("layer.weight", "norm.scale")
        )
        seen["rng"] = got["rng"]
        seen["iteration"] = got["iteration"]
    seen["files"] = sorted(os.listdir(ckpt))
    publish(Path(f"{out}.{rank}"), json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
