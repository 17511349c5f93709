"""What the integrations that adopt a framework's own checkpoint directories share
(the HF Trainer's ``checkpoint-N``, accelerate's ``checkpoint_N``): the steps a node
holds of a job's adoptions, the step every writing process agrees on, and the
collectives around them over ``torch.distributed`` (none with one process)."""

from __future__ import annotations

import sys

from ckptd.core.errors import CheckpointNotFound

from .client import Client


def adopted_steps(client: Client) -> list[int]:
    """The steps this node's daemon holds whole of the job's adoptions, oldest first."""
    return sorted(
        c.step
        for c in client.list()
        if c.adopted and c.tiers and c.state != "STAGING" and not c.abandoned
    )


def world() -> int:
    """The number of processes in torch.distributed's default group (1: none)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return int(dist.get_world_size())


def agree(client: Client, step: int | None, writes: bool) -> int | None:
    """The step every writing process's node holds (the newest, or ``step`` if all
    hold it), gathered over torch.distributed; None if there is none. A collective."""
    import torch.distributed as dist

    mine: list[int] | None = adopted_steps(client) if writes else None
    everyone: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    held = [set(s) for s in everyone if s is not None]
    common = set.intersection(*held) if held else set()
    if step is not None:
        if step not in common:
            raise CheckpointNotFound(
                f"step {step} of job {client.job!r} is not held by every node (steps all "
                f"of them hold: {sorted(common)[-10:]}); pick one of those"
            )
        return step
    return max(common) if common else None


def gather(error: str) -> list[str]:
    """Every process's ``error`` ("": none), in rank order (just ours with one process):
    no process is left waiting for a node whose copy could not be put back."""
    if world() == 1:
        return [error]
    import torch.distributed as dist

    everyone: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(everyone, error)
    return everyone


def barrier() -> None:
    """torch.distributed's barrier (nothing with one process)."""
    if world() > 1:
        import torch.distributed as dist

        dist.barrier()


__all__ = ["adopted_steps", "agree", "barrier", "gather", "world"]
