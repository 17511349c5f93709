"""Multi-process jobs: agree on the step to restore through the trainer's own runtime.

Daemons never talk to each other. Each process asks its node's daemon which
steps it can restore (a local copy, or a complete copy of a node's part in the
bucket), the processes all-gather those lists, and every one picks the newest
step that all of them can restore. The all-gather is ``torch.distributed``'s
when its default process group is initialized (a PyTorch job: DDP, FSDP,
torchrun), else JAX's ``multihost_utils.process_allgather``. Either way it is
a collective: every process must call it at the same point.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .client import Client

MAX_CANDIDATES = 64
"""Newest restorable steps each process offers (older ones cannot win anyway
unless the newest 64 all fail somewhere)."""


def restorable_steps(client: Client, healthy: bool = False) -> list[int]:
    """Steps of the job's live history this process's node can restore from some tier,
    newest first (adopted directories are not ckptd arrays: their framework restores
    them; abandoned steps are off the live history); ``healthy``: only those known to
    hold no NaN/Inf on this node."""
    rows = client.list()
    return sorted(
        {
            c.step
            for c in rows
            if c.tiers
            and c.state != "STAGING"
            and not c.adopted
            and not c.abandoned
            and (c.healthy or not healthy)
        },
        reverse=True,
    )


def agree_on_step(client: Client, healthy: bool = False) -> int | None:
    """The newest step every process can restore (None: start from scratch);
    ``healthy``: known healthy on every node (each node counts its own shards, so a
    step with NaN anywhere is skipped everywhere).

    A collective: every process of the job must call it (over ``torch.distributed``
    when its process group is initialized, else over JAX's runtime).
    """
    mine = np.full(MAX_CANDIDATES, -1, np.int64)
    steps = restorable_steps(client, healthy)[:MAX_CANDIDATES]
    mine[: len(steps)] = steps
    everyone = _allgather(mine).reshape(-1, MAX_CANDIDATES)
    common = set(everyone[0].tolist())
    for row in everyone[1:]:
        common &= set(row.tolist())
    common.discard(-1)
    return max(common) if common else None


def _torch_group_ready() -> bool:
    """Is torch.distributed's default process group up? (Never imports torch itself.)"""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _allgather(mine: np.ndarray) -> np.ndarray:
    """Every process's ``mine``, stacked in rank order."""
    if _torch_group_ready():
        import torch
        import torch.distributed as dist

        # A CPU tensor works on gloo; NCCL groups need it on this rank's device.
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        local = torch.from_numpy(mine).to(device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        return torch.stack(gathered).cpu().numpy()
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(mine))


def restore_agreed(
    client: Client, target: Any = None, healthy: bool = False
) -> tuple[int | None, Any, dict[str, Any]]:
    """Agree on a step (a collective), then restore it: ``(step, tree, metadata)``;
    ``(None, None, {})`` when no step is restorable everywhere (``healthy``: see
    :func:`agree_on_step`)."""
    step = agree_on_step(client, healthy)
    if step is None:
        return None, None, {}
    tree, meta = client.restore(step=step, target=target)
    return step, tree, meta


__all__ = ["agree_on_step", "restorable_steps", "restore_agreed"]
