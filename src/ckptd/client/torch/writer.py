"""``CkptdWriter``: a DCP ``StorageWriter`` that hands each rank's shards to ckptd.

Every rank saves its write items as one ckptd rank of the step (``Client.save``:
one copy into the daemon's shared-memory lease, views of the tensors, no
serialisation). It is also ``dcp.async_save``'s stager (lease_stage.py): the state
is copied once, straight into the lease, and committed from there as it lies.
DCP knows the checkpoint's ``Metadata`` only in ``finish()``,
on the coordinator, after every rank has written. So the coordinator keeps its
own items until then and commits them together with the pickled metadata (a
uint8 array: crc32c covers it like any shard). The daemon makes a step LOCAL
only when every rank of the node has committed, so a step is never restorable
without its metadata, and a save whose coordinator fails never becomes one
(the daemon fails the incomplete step after its step timeout).
"""

from __future__ import annotations

import io
import os
import uuid
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptd.core.errors import InvalidArgument

from ..client import Client
from ..handle import SaveHandle
from ..leaves.torch_tensors import to_array
from . import lease_stage
from .common import (
    COORDINATOR,
    FORMAT,
    ITEMS,
    METADATA,
    ClientSource,
    checkpoint_url,
    encode_metadata,
    is_checkpoint_id,
    item_key,
    parse_checkpoint_id,
    world,
)

_STAGES = (None, "local", "durable")


class CkptdWriter(StorageWriter):
    """Saves a DCP checkpoint as ckptd step ``step`` of the client's job.

    ``client_or_job``: a :class:`~ckptd.client.Client` whose rank is this
    process's DCP rank, or a job name (a client is then made on first use with
    ``rank=dist.get_rank()``, ``world_size=dist.get_world_size()`` and
    ``node_ranks`` — default: torchrun's ranks of this node when
    ``LOCAL_WORLD_SIZE`` says the job spans nodes, else every rank; ``socket``
    and ``client_options`` are passed on). Only a writer made from a job name
    can be pickled, which DCP's process executor needs.

    The step comes from ``checkpoint_id`` (``dcp.save(..., checkpoint_id=N)`` or
    ``"ckptd://<job>/<N>"``), else from ``step``. ``wait``: what ``finish()``
    waits for on the coordinator — ``"local"`` (default: ``dcp.save`` returns
    when the step is restorable), ``"durable"`` (in the bucket too) or None (the
    daemon owns the bytes; a crash of the trainer no longer loses them).
    ``metadata``, ``milestone``, ``metrics``: as for :meth:`Client.save`.
    ``async_staging``: as ``async_save``'s stager, copy the state into the daemon's
    memory on a thread of its own (``async_save`` then returns an
    ``AsyncSaveResponse`` whose ``staging_completion`` says when the copy is done:
    the state must not change before it). ``_extensions`` (DCP's stream extensions,
    such as ``ZStandard``): refused, see :func:`refuse_extensions`.
    One save at a time per writer: wait for an ``async_save`` before the next.
    """

    def __init__(
        self,
        client_or_job: Client | str,
        step: int | None = None,
        *,
        socket: str | os.PathLike[str] | None = None,
        node_ranks: list[int] | None = None,
        wait: str | None = "local",
        timeout: float = 600.0,
        metadata: dict[str, Any] | None = None,
        milestone: bool = False,
        metrics: dict[str, float] | None = None,
        client_options: dict[str, Any] | None = None,
        async_staging: bool = False,
        _extensions: Sequence[Any] | None = None,
    ) -> None:
        super().__init__()
        refuse_extensions(_extensions)
        if wait not in _STAGES:
            raise InvalidArgument(f"wait must be one of {_STAGES}, not {wait!r}")
        self._source = ClientSource(client_or_job, socket, node_ranks, client_options or {})
        self.job = self._source.job
        self.step = None if step is None else parse_checkpoint_id(step, self.job)
        self.wait, self.timeout = wait, timeout
        self.user_metadata = dict(metadata or {})
        self.milestone, self.metrics = milestone, metrics
        self.rank = 0
        self.is_coordinator = True
        self.handle: SaveHandle | None = None
        """The coordinator's handle of the last save (``handle.wait("durable")``)."""
        self._pending: dict[str, np.ndarray] = {}
        self._save_id = uuid.uuid4().hex
        self.async_staging = async_staging
        self._stager: ThreadPoolExecutor | None = None
        self._stage: lease_stage.LeaseStage | None = None
        """The lease ``stage()`` filled for the save in progress (``async_save``)."""
        self.handoff = ""
        """How the last save reached the daemon: ``"in place"`` (staged by async_save:
        committed from the lease it was copied into) or ``"copied"``."""

    def __getstate__(self) -> dict[str, Any]:
        # DCP's checkpoint process gets a copy without this process's lease (its
        # staged tensors arrive there as copies): it saves them the plain way.
        state = self.__dict__.copy()
        state["_stage"] = state["_stager"] = None
        return state

    # -- async_save's stager (torch.distributed.checkpoint.staging.AsyncStager) ----------
    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        """False: :meth:`stage` has finished its copy when it returns."""
        return False

    def stage(self, state_dict: Any) -> Any:
        """The state copied into a lease of the daemon (one copy: the write that follows
        commits it as it lies), tensors replaced by views of it; training may go on.
        With ``async_staging``: a future of that, the copy made on a thread."""
        if self.async_staging:
            if self._stager is None:
                self._stager = ThreadPoolExecutor(1, "ckptd-dcp-stage")
            return self._stager.submit(self._stage_now, state_dict)
        return self._stage_now(state_dict)

    def _stage_now(self, state_dict: Any) -> Any:
        if self._stage is not None:
            self._stage.release()  # the previous save of this writer never committed it
            self._stage = None
        rank = world()[0]
        try:
            staged, self._stage = lease_stage.stage(
                self._source.get(rank), state_dict, rank == COORDINATOR
            )
        except lease_stage.Unsupported:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            stager = DefaultStager(StagingOptions(False, False, False, False))
            try:
                return stager.stage(state_dict)
            finally:
                stager.close()
        # A writer dropped before it committed (an error, a checkpoint process) gives
        # its lease back; committed, this does nothing.
        weakref.finalize(self, self._stage.release)
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies before it returns."""

    # -- identity ------------------------------------------------------------
    @property
    def checkpoint_id(self) -> str | None:
        """``ckptd://<job>/<step>`` of the save in progress (DCP logs it)."""
        return checkpoint_url(self.job, self.step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for ``ckptd://<job>/<step>`` and step numbers."""
        return is_checkpoint_id(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save begins; ``checkpoint_id`` (if given) names its step."""
        if checkpoint_id is not None:
            self.step = parse_checkpoint_id(checkpoint_id, self.job)
        self._pending = {}
        self._save_id = uuid.uuid4().hex
        self.handle = None

    def storage_meta(self) -> StorageMeta | None:
        """The checkpoint's URL and this save's id, recorded in DCP's metadata."""
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self._save_id)

    # -- the protocol ----------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Learn this process's role; make (or check) the client for its rank."""
        if self.step is None:
            raise InvalidArgument(
                f"no ckptd step for this save of job {self.job!r}: pass checkpoint_id=<step> "
                f"(or 'ckptd://{self.job}/<step>') to dcp.save, or CkptdWriter(..., step=N)"
            )
        if not kwargs.get("use_collectives", True) and world()[1] > 1:
            # Then every rank would write its own metadata, and none the whole step's.
            raise InvalidArgument("ckptd's DCP writer needs use_collectives=True")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", world()[0]))
        self._source.get(self.rank)
        self._pending = {}

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Unchanged: where an item goes is fixed by its rank and index."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Unchanged (every rank saves its own items to its own ckptd rank)."""
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Hand this rank's items to the daemon (the coordinator: at ``finish()``)."""
        items: dict[str, np.ndarray] = {}
        results = []
        stage = self._stage
        for item in plan.items:
            data = planner.resolve_data(item)
            key = item_key(item.index, item.type == WriteItemType.SHARD)
            tdt = ""
            if item.type == WriteItemType.BYTE_IO:
                if not isinstance(data, io.BytesIO):
                    raise InvalidArgument(f"{item.index.fqn}: DCP resolved bytes to {type(data)}")
                arr = np.frombuffer(data.getvalue(), np.uint8)
            elif isinstance(data, torch.Tensor):
                arr, tdt = to_array(data)
            else:
                raise InvalidArgument(f"{item.index.fqn}: DCP resolved a tensor to {type(data)}")
            if key in items:
                raise InvalidArgument(f"two write items of rank {self.rank} share key {key!r}")
            held = (
                stage.holds(data) if stage is not None and isinstance(data, torch.Tensor) else None
            )
            if stage is not None and not stage.failed and held is None:
                # Not a staged tensor as staged (a pickled object): after the tensors.
                placed = stage.append(arr) if arr.flags.c_contiguous else None
                if placed is None:
                    stage.failed = True  # no room: the plain way (_save)
                else:
                    arr = placed
            items[key] = arr
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=arr.nbytes,
                    storage_data={"rank": self.rank, "key": key, "dtype": tdt},
                )
            )
        if self.is_coordinator:
            # Committed with the metadata in finish(): the step is complete with it.
            self._pending = items
        else:
            self._save({ITEMS: items}, {})
            self._save_id = uuid.uuid4().hex  # the next save's
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: commit its items and DCP's metadata; the step completes."""
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = self.storage_meta()
        self._save_id = uuid.uuid4().hex  # the next save's
        encoded = encode_metadata(metadata)
        stage = self._stage
        if stage is not None and not stage.failed:
            placed = stage.append(encoded)
            if placed is None:
                stage.failed = True
            else:
                encoded = placed
        tree = {ITEMS: self._pending, METADATA: encoded}
        self._pending = {}
        dcp = {"format": FORMAT, "world_size": len(results), "coordinator": self.rank}
        self.handle = self._save(tree, {"dcp": dcp})
        if self.wait is not None:
            self.handle.wait(self.wait, timeout=self.timeout)

    def _save(self, tree: dict[str, Any], extra: dict[str, Any]) -> SaveHandle:
        assert self.step is not None
        client = self._source.get(self.rank)
        meta = {**self.user_metadata, **extra}
        stage, self._stage = self._stage, None
        packed = stage.compact(tree) if stage is not None and not stage.failed else None
        if stage is not None and packed is not None:
            # Staged by async_save: handed off as it lies in the lease, no copy.
            handle = client.low_level.commit_in_place(
                self.step,
                packed,
                stage.lease,
                stage.mm,
                meta,
                milestone=self.milestone,
                metrics=self.metrics,
            )
            if handle is not None:
                stage.done, self.handoff = True, "in place"
                return handle
        self.handoff = "copied"
        try:  # copied into a lease of its own (from the staged lease, if there is one)
            return client.save(
                self.step, tree, meta, milestone=self.milestone, metrics=self.metrics
            )
        finally:
            if stage is not None:
                stage.release()

    def close(self) -> None:
        """Give back a lease a stage left; close the client this writer made (one given
        to it stays open)."""
        if self._stager is not None:
            self._stager.shutdown(wait=True)
            self._stager = None
        if self._stage is not None:
            self._stage.release()
            self._stage = None
        self._source.close()


def refuse_extensions(extensions: Sequence[Any] | None) -> None:
    """DCP's ``_extensions`` transform the byte streams of FileSystemWriter's files
    (``ZStandard`` compresses them); ckptd hands tensors to the daemon as they lie in
    memory, and its files are checksummed arrays that any tool maps: refused rather
    than silently ignored."""
    if extensions:
        names = ", ".join(type(e).__name__ for e in extensions)
        raise InvalidArgument(
            f"CkptdWriter does not apply DCP stream extensions ({names}): ckptd saves "
            "tensors uncompressed through shared memory. Drop _extensions=..., or save "
            "with dcp.FileSystemWriter(path, _extensions=...) where compressed files "
            "are wanted"
        )
