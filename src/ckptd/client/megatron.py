"""Megatron-Core ``dist_checkpointing`` (Megatron-LM, NeMo, Megatron-Bridge) saving
through ckptd: a sharded save strategy whose tensors go into the node daemon's
shared memory through :class:`~ckptd.client.torch.CkptdWriter`, and the load
strategy that reads them back through :class:`~ckptd.client.torch.CkptdReader`::

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )
    from ckptd.client import megatron as ckptd_megatron

    save = ckptd_megatron.strategies("run-42")       # and registers the load strategy
    dist_checkpointing.save(sharded_sd, f"{ckpt}/iter_0000100",
                            sharded_strategy=FullyParallelSaveStrategyWrapper(save))
    ...
    ckptd_megatron.ensure_local(f"{ckpt}/iter_0000100", "run-42")  # after a lost node
    state = dist_checkpointing.load(sharded_sd, f"{ckpt}/iter_0000100")

- **What is where.** Megatron writes ``common.pt`` (rank 0's non-sharded state) and
  ``metadata.json`` (the format: backend ``ckptd``) into the checkpoint directory
  itself. The sharded tensors and objects (DCP's ``.distcp`` files and
  ``.metadata`` with Megatron's own strategy) are ckptd step N, N taken from the
  directory's name (``iter_0000100`` is step 100), with a copy of ``common.pt``, so
  the bucket holds the whole checkpoint: :func:`ensure_local` writes the two files
  back into an empty directory before Megatron's ``load`` looks for them.
- **Async.** ``async_save`` returns once every tensor is in the daemon's memory
  (the copy is the snapshot: no staging to pinned memory, no writer process); the
  ``AsyncRequest`` it returns has no background work, and its finalize step, which
  Megatron runs on every rank before it writes ``metadata.json``, waits until the
  step is LOCAL. So ``metadata.json``, Megatron's mark of a complete checkpoint, is
  never written before ckptd's copy is on the node's disk.
- **Fully parallel save.** ``FullyParallelSaveStrategyWrapper`` works unchanged (it
  decides which rank saves each replicated shard, then calls this strategy).

Megatron-Core's own torch_dist strategy calls CUDA in its async path; this one
runs on CPU too (its tests: Megatron-Core's real ``save``/``load``, gloo).
See docs/integrations/megatron.md.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import torch

# Megatron-Core ships no type information.
from megatron.core.dist_checkpointing import (  # type: ignore[import-untyped]
    ShardedObject,
    ShardedTensor,
)
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config  # type: ignore[import-untyped]
from megatron.core.dist_checkpointing.dict_utils import nested_values  # type: ignore[import-untyped]
from megatron.core.dist_checkpointing.strategies import (  # type: ignore[import-untyped]
    torch as mcore_torch,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest  # type: ignore[import-untyped]
from megatron.core.dist_checkpointing.strategies.base import (  # type: ignore[import-untyped]
    StrategyAction,
    register_default_strategy,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ckptd.core.errors import InvalidArgument

from .client import Client
from .handle import SaveHandle
from .torch import CkptdReader, CkptdWriter
from .torch.common import world

BACKEND = "ckptd"
"""The backend name Megatron records in ``metadata.json`` (and looks the load up by)."""
VERSION = 1
COMMON = "ckptd.megatron/common.pt"
"""The step's copy of Megatron's ``common.pt`` (a DCP bytes item)."""
_STEP = re.compile(r"(\d+)$")


def step_of(checkpoint_dir: str | os.PathLike[str]) -> int:
    """The ckptd step of a Megatron checkpoint directory: the number its name ends
    with (``iter_0000100``: 100)."""
    match = _STEP.search(Path(checkpoint_dir).name)
    if match is None:
        raise InvalidArgument(
            f"{checkpoint_dir!r}: ckptd takes the step from the checkpoint directory's "
            "name, which must end with it (Megatron's iter_0000100)"
        )
    return int(match.group(1))


class CkptdSaveStrategy(mcore_torch.TorchDistSaveShardedStrategy):  # type: ignore[misc]
    """Megatron's sharded save into ckptd (see the module). ``job`` or ``client``
    (a :class:`~ckptd.client.Client` whose rank is this process's global rank);
    ``socket``, ``client_options``: for the client made from ``job``; ``wait``:
    what the finalize step waits for, ``"local"`` or ``"durable"``;
    ``keep_only_main_replica``: as Megatron's (save each replicated shard once)."""

    def __init__(
        self,
        job: str | None = None,
        *,
        client: Client | None = None,
        socket: str | os.PathLike[str] | None = None,
        client_options: dict[str, Any] | None = None,
        wait: str = "local",
        keep_only_main_replica: bool = True,
    ) -> None:
        super().__init__(BACKEND, VERSION, keep_only_main_replica=keep_only_main_replica)
        if (job is None) == (client is None):
            raise TypeError("give the job's name (CkptdSaveStrategy('run-42')) or a client=")
        if wait not in ("local", "durable"):
            raise InvalidArgument(f"wait must be 'local' or 'durable', not {wait!r}")
        options = {"supersede": False, **(client_options or {})}  # each named step is written
        self._writer = CkptdWriter(
            client if client is not None else str(job),
            socket=socket,
            wait=None,
            client_options=options,
        )
        self.wait = wait

    @property
    def job(self) -> str:
        """The ckptd job the steps are saved to."""
        return str(self._writer.job)

    def can_handle_sharded_objects(self) -> bool:  # a method in Megatron's class, too
        """ShardedObjects go through DCP as bytes items, like tensors into the step."""
        return True

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> AsyncRequest:
        """Hand every tensor to the daemon (returns when they are in its memory); the
        request's finalize waits until the step is LOCAL (or DURABLE)."""
        step = step_of(checkpoint_dir)
        grouped, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        state = mcore_torch.mcore_to_pyt_state_dict(grouped, False)
        common = Path(checkpoint_dir) / "common.pt"
        if world()[0] == 0 and common.is_file():  # rank 0 wrote it just before
            state[COMMON] = io.BytesIO(common.read_bytes())
        planner = mcore_torch.MCoreSavePlanner(
            dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
        )
        self._writer.step = step
        dcp_save(state, storage_writer=self._writer, planner=planner)
        client, stage = self._writer._source.get(world()[0]), self.wait

        def settled() -> None:
            SaveHandle(client, step).wait(stage, timeout=self._writer.timeout)

        return AsyncRequest(None, (), [settled])

    def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        """:meth:`async_save`, then its finalize (the step LOCAL) before returning."""
        request = self.async_save(sharded_state_dict, checkpoint_dir)
        for finalize in request.finalize_fns:
            finalize()


class CkptdLoadStrategy(mcore_torch.TorchDistLoadShardedStrategy):  # type: ignore[misc]
    """Megatron's sharded load from ckptd: the step named by the checkpoint
    directory, from the fastest tier holding it (the bucket after a lost node)."""

    def __init__(
        self,
        job: str,
        *,
        socket: str | os.PathLike[str] | None = None,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.job, self.socket, self.client_options = job, socket, client_options

    def _reader(self, checkpoint_dir: Any) -> CkptdReader:
        return CkptdReader(
            self.job,
            step_of(checkpoint_dir),
            socket=self.socket,
            client_options=self.client_options,
        )

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        """Megatron's state dict for ``sharded_state_dict``, read from the step."""
        tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        shape_checked = [t for t in tensors if not t.allow_shape_mismatch]
        flexible = {t.key: t for t in tensors if t.allow_shape_mismatch}
        keyed, flat, renamed = mcore_torch._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        state = mcore_torch.mcore_to_pyt_state_dict(keyed, True)
        reader = self._reader(checkpoint_dir)
        planner = mcore_torch.MCoreLoadPlanner(
            shapes_validation_sharded_tensors=shape_checked,
            allow_shape_mismatch_sharded_tensors=flexible,
        )
        dcp_load(state, storage_reader=reader, planner=planner)
        self.cached_global_metadata = reader.read_metadata()
        loaded = {k: mcore_torch._unwrap_pyt_sharded_tensor(v) for k, v in state.items()}
        loaded = mcore_torch._replace_sharded_keys_with_state_dict_keys(loaded, flat, renamed)
        mcore_torch._restore_dict_types(loaded, sharded_state_dict)
        return loaded

    def load_tensors_metadata(self, checkpoint_dir: Any, metadata: Any = None) -> Any:
        """The saved tensors' shapes and dtypes, from the step's DCP metadata."""
        if metadata is None:
            metadata = self._reader(checkpoint_dir).read_metadata()
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir: Any) -> Any:
        """The saved tensors and objects, from the step's DCP metadata."""
        metadata = self._reader(checkpoint_dir).read_metadata()
        found = {}
        for key, stored in metadata.state_dict_metadata.items():
            if isinstance(stored, BytesStorageMetadata) and key != COMMON:
                obj = ShardedObject.empty_from_unique_key(key)
                found[obj.unique_key] = obj
        found.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return found


def strategies(
    job: str,
    *,
    socket: str | os.PathLike[str] | None = None,
    client_options: dict[str, Any] | None = None,
    wait: str = "local",
) -> CkptdSaveStrategy:
    """The save strategy for ``job``, after registering its load strategy with
    Megatron (backend ``ckptd``: ``dist_checkpointing.load`` then finds it from the
    directory's ``metadata.json``)."""
    loader = CkptdLoadStrategy(job, socket=socket, client_options=client_options)
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, loader)
    return CkptdSaveStrategy(job, socket=socket, client_options=client_options, wait=wait)


def ensure_local(
    checkpoint_dir: str | os.PathLike[str],
    job: str,
    *,
    socket: str | os.PathLike[str] | None = None,
) -> bool:
    """Make ``checkpoint_dir`` loadable by Megatron on this node: when its
    ``metadata.json`` or ``common.pt`` is missing (a lost node, a fresh disk), write
    them from the step ckptd holds (from the bucket if need be). Every process may
    call it; the files are written atomically. True if it wrote anything."""
    where = Path(checkpoint_dir)
    if (where / "metadata.json").is_file() and (where / "common.pt").is_file():
        return False
    step = step_of(where)
    holder: dict[str, Any] = {COMMON: io.BytesIO()}
    dcp_load(holder, storage_reader=CkptdReader(job, step, socket=socket), no_dist=True)
    where.mkdir(parents=True, exist_ok=True)
    tmp = where / f".common.pt.{os.getpid()}.tmp"
    common = holder[COMMON]
    if isinstance(common, io.BytesIO):
        tmp.write_bytes(common.getvalue())
    else:  # DCP hands bytes items back unpickled: common.pt's dict, saved again as Megatron does
        torch.save(common, tmp)
    os.replace(tmp, where / "common.pt")
    save_config(CheckpointingConfig(BACKEND, VERSION), str(where))
    return True


__all__ = [
    "BACKEND",
    "CkptdLoadStrategy",
    "CkptdSaveStrategy",
    "ensure_local",
    "step_of",
    "strategies",
]
