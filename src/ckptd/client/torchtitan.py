"""torchtitan through ckptd: its checkpoint manager saving and loading ckptd steps.

A torchtitan user adds one flag to the command line and names the job as the folder::

    torchrun ... -m torchtitan.train --module llama3 --config llama3_8b \\
        --override.imports ckptd.client.torchtitan.ckptd_checkpoint \\
        --checkpoint.enable --checkpoint.folder ckptd://run-42

(or, in a config function, ``config.checkpoint =
CkptdCheckpointManager.Config(enable=True, folder="ckptd://run-42")``).
:class:`CkptdCheckpointManager` is torchtitan's own DCP ``CheckpointManager``
(same config, same save schedule, same state: model parts, optimizers, lr
schedulers, dataloader, train state) with four hooks changed:

- ``dcp_save`` hands each rank's shards to the node's daemon through
  :class:`~ckptd.client.torch.CkptdWriter` (shared memory, no byte stream through a
  filesystem), as ckptd step ``N`` of the job for torchtitan's ``step-N``; with
  ``async_mode="async"`` the writer stages the state straight into the daemon's
  memory and commits it in the background; with ``"async_with_pinned_mem"`` that
  copy itself runs on a thread too (the trainer waits for it before the optimizer
  step, as torchtitan does for its pinned-memory stager);
- ``dcp_load`` reads through :class:`~ckptd.client.torch.CkptdReader` (the daemon's
  verified memory; a part missing locally comes from the bucket);
- ``_find_load_step`` (the latest step on resume) is the newest step every rank's
  node can restore from some ckptd tier, agreed over ``torch.distributed``, so a
  node whose disk was wiped resumes from the bucket; ``--checkpoint.load_step``
  names a step explicitly;
- purging: ``keep_latest_k`` (torchtitan's default 10) becomes the job's ckptd
  retention, ``KeepLatest(k)`` in every tier, within the operator's limits; 0
  (torchtitan keeps every step) leaves the node's retention policy.

Importing this module imports torchtitan (``import ckptd.client`` does not). See
docs/integrations/torchtitan.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as load_checkpoint
from torch.distributed.checkpoint.state_dict_saver import async_save, save

# torchtitan ships no type information.
from torchtitan.components.checkpoint import (  # type: ignore[import-untyped]
    MODEL,
    AsyncMode,
    CheckpointManager,
)
from torchtitan.config.override import derive, override  # type: ignore[import-untyped]
from torchtitan.tools.logging import logger  # type: ignore[import-untyped]
from torchtitan.tools.utils import GarbageCollection  # type: ignore[import-untyped]

from ckptd.core.errors import FailedPrecondition, InvalidArgument

from .client import Client
from .distributed import agree_on_step, restorable_steps
from .torch import CkptdReader, CkptdWriter
from .torch.common import SCHEME, node_ranks_for, world

_FOLDER = re.compile(r"ckptd://([^/]+)/?")
_WAITS = {"handoff": None, "local": "local", "durable": "durable"}


def job_of(folder: str) -> str:
    """The job named by a checkpoint folder ``ckptd://<job>``; raises InvalidArgument."""
    m = _FOLDER.fullmatch(folder.strip())
    if m is None:
        raise InvalidArgument(
            f"checkpoint.folder {folder!r} names no ckptd job: with ckptd's checkpoint "
            "manager set --checkpoint.folder ckptd://<job> (the job's steps are kept "
            "by the node's ckptd daemon, not in a directory)"
        )
    return m.group(1)


def agreed_step(client: Client) -> int | None:
    """The newest step every rank's node can restore (None: none). A collective over
    the default process group when ``torch.distributed`` is initialized."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        steps = restorable_steps(client)
        return steps[0] if steps else None
    return agree_on_step(client)


class CkptdCheckpointManager(CheckpointManager):  # type: ignore[misc]
    """torchtitan's DCP ``CheckpointManager`` saving to and loading from ckptd (see
    the module's docstring). Built by torchtitan from :class:`Config` like its own."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's checkpoint config; ``folder`` is ``ckptd://<job>``."""

        socket: str = ""
        """The daemon's socket ("": ``$CKPTD_SOCKET``, else ckptd's default)."""

        wait: Literal["handoff", "local", "durable"] = "local"
        """What a save waits for before it counts as done (a synchronous save
        returns then; an async one completes its future then): ``"handoff"`` (the
        daemon owns the bytes: a crash of the trainer no longer loses them),
        ``"local"`` (on the node's disk, restorable), ``"durable"`` (in the bucket)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.enable:
                job_of(self.folder)
            if self.wait not in _WAITS:
                raise ValueError(f"checkpoint.wait must be one of {sorted(_WAITS)}")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.job = job_of(config.folder)
        rank, size = world()
        self.client = Client(
            self.job,
            config.socket or None,
            rank=rank,
            node_ranks=node_ranks_for(rank, size),
            world_size=size,
            supersede=False,  # torchtitan names each step it saved: each is written
        )
        pinned = self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
        self.writer = CkptdWriter(self.client, wait=_WAITS[config.wait], async_staging=pinned)
        # The writer is the async stager: torchtitan's pinned-memory stager (its
        # DefaultStager) would copy the state once more, and needs an accelerator.
        self.stager = self.writer
        self._closed = False
        keep = f"KeepLatest({int(self.keep_latest_k)})" if self.keep_latest_k > 0 else None
        try:  # None (keep every step) too: an earlier run's policy must not stay
            self.client.set_retention(keep)
        except FailedPrecondition as exc:  # the operator keeps every job's retention
            logger.warning(f"checkpoint.keep_latest_k is not applied: {exc}")

    def _close(self) -> None:
        if getattr(self, "_closed", True):
            return  # closed already (torchtitan's close, then __del__), or never opened
        self._closed = True
        super()._close()
        self.writer.close()
        self.client.close()

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        """Save ``state_dict`` as the step ``checkpoint_id`` (``ckptd://<job>/step-N``)
        names: through the daemon, synchronously or with ``dcp.async_save``."""
        if to_hf:
            raise InvalidArgument(
                "ckptd saves DCP steps, not Hugging Face safetensors: set "
                "checkpoint.last_save_in_hf=False (export the model from a ckptd step "
                "afterwards)"
            )
        result: Any = None
        if async_mode == AsyncMode.DISABLED:
            save(state_dict, checkpoint_id=checkpoint_id, storage_writer=self.writer)
        else:
            # The writer stages (into the daemon's memory) and writes; a thread, not a
            # checkpoint process: the staged lease belongs to this process.
            result = async_save(
                state_dict,
                checkpoint_id=checkpoint_id,
                storage_writer=self.writer,
                process_group=self.pg,
            )
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """Load a ckptd step into ``state_dict`` (an initial load from a directory or
        Hugging Face weights is torchtitan's own)."""
        if from_hf or not str(checkpoint_id).startswith(SCHEME):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        load_checkpoint(
            state_dict, checkpoint_id=checkpoint_id, storage_reader=CkptdReader(self.client)
        )
        if MODEL in self.states:  # torchtitan flattens the model's state into the dict
            self.states[MODEL].load_state_dict(state_dict)

    def _find_load_step(self, folder: str = "") -> int:
        """The newest step every rank can restore from a ckptd tier (-1: none)."""
        step = agreed_step(self.client)
        return -1 if step is None else step

    def _should_purge(self) -> bool:
        return False  # the daemon's retention decides (see __init__)

    def _load(self, step: int = -1) -> bool:
        """Resume from ckptd: ``step``, else the newest step every rank can restore;
        with none, torchtitan's initial load (``initial_load_path``, HF weights) or a
        fresh start."""
        if step == -1:
            step = self._find_load_step()
        elif step not in restorable_steps(self.client):
            raise FileNotFoundError(
                f"--checkpoint.load_step={step}: job {self.job!r} has no step {step} that "
                f"this node can restore (it has {restorable_steps(self.client) or 'none'})"
            )
        if step == -1:
            return self._initial_load()
        checkpoint_id = self._create_checkpoint_id(step)
        logger.info(f"Loading the checkpoint from {checkpoint_id}.")
        states = self._states_to_load(model_only=step == 0)  # step 0: a seed checkpoint
        self.dcp_load(states, checkpoint_id, from_hf=False, from_quantized=False)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        return True

    def _initial_load(self) -> bool:
        if not self.initial_load_path and not self.initial_load_in_hf:
            logger.info(f"No step of job {self.job!r} in ckptd: this is a fresh start.")
            return False
        path = self.initial_load_path or self.sd_adapter.hf_assets_path
        logger.info(f"No step of job {self.job!r} in ckptd: loading {path}.")
        states = self._states_to_load(self.initial_load_model_only)
        self.dcp_load(states, path, self.initial_load_in_hf, self.initial_load_in_hf_quantized)
        return True


@override(  # type: ignore[untyped-decorator]
    target=CheckpointManager.Config,
    exact=True,
    description="ckptd: torchtitan's checkpoints saved and loaded through the node's daemon",
)
def ckptd_checkpoint(cfg: Any, **settings: Any) -> CkptdCheckpointManager.Config:
    """torchtitan override (``--override.imports ckptd.client.torchtitan.ckptd_checkpoint``):
    the trainer's checkpoint config as :class:`CkptdCheckpointManager`'s, every
    setting kept; ``settings`` (the override's JSON, e.g.
    ``'ckptd.client.torchtitan.ckptd_checkpoint={"wait": "durable"}'``) sets
    ckptd's own fields, ``socket`` and ``wait``."""
    config: CkptdCheckpointManager.Config = derive(cfg, CkptdCheckpointManager.Config, **settings)
    return config


__all__ = ["CkptdCheckpointManager", "agreed_step", "ckptd_checkpoint", "job_of"]
