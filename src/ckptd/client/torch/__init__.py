"""PyTorch through ckptd: torch tensors in ``Client.save`` / ``restore``, and Distributed
Checkpoint (DCP) through the daemon.

``dcp.save(state, checkpoint_id=N, storage_writer=CkptdWriter("run-42"))`` hands
each rank's shards to the node daemon over shared memory (one copy, no
serialisation of tensors) as ckptd step ``N``; ``dcp.load(state,
checkpoint_id=N, storage_reader=CkptdReader("run-42"))`` reads them back from
the daemon's verified restore memory, onto any number of ranks. ``async_save``
works with both of DCP's executors (the process executor needs a writer made
from a job name). A checkpoint id is a step: ``N``, ``"N"``,
``"ckptd://<job>/<N>"``, ``"ckptd://<job>/step-<N>"`` or a path ending in
``step-<N>`` (torchtitan's ids; docs/integrations/torchtitan.md).

Importing this package imports torch; ``import ckptd.client`` does not. The DCP
classes load ``torch.distributed.checkpoint`` on first use, so ``Client.save``
of a state dict (``.tensors``) does not pay for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .common import is_checkpoint_id, parse_checkpoint_id
    from .reader import CkptdReader
    from .writer import CkptdWriter

__all__ = ["CkptdReader", "CkptdWriter", "is_checkpoint_id", "parse_checkpoint_id"]

_WHERE = {
    "CkptdReader": ".reader",
    "CkptdWriter": ".writer",
    "is_checkpoint_id": ".common",
    "parse_checkpoint_id": ".common",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value
