"""``CkptdReader``: a DCP ``StorageReader`` over ckptd's verified restore memory.

``read_metadata`` restores the coordinator's part of the step (rank 0) and
unpickles DCP's ``Metadata`` from it; ``read_data`` restores the part of every
saving rank that holds an item this rank's plan reads (through the daemon:
the local tier, or the bucket when the local copy is gone or corrupt), and
copies each planned slice (``storage_offsets`` / ``lengths``) from the
verified views straight into the target tensors. So a checkpoint saved by 4
ranks loads on 2, or on 1, or on 8. A rank saved on another node is read from
that node's part, which the daemon fetches from the bucket (``FetchPeers``).
"""

from __future__ import annotations

import io
import json
import os
import uuid
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptd.core.errors import CheckpointCorrupt, CheckpointNotFound, InvalidArgument

from .. import mapped_views
from ..client import Client
from ..distributed import restorable_steps
from ..leaves.torch_tensors import to_tensor
from .common import (
    COORDINATOR,
    ITEMS,
    METADATA,
    ClientSource,
    checkpoint_url,
    decode_metadata,
    is_checkpoint_id,
    parse_checkpoint_id,
    world,
)


class CkptdReader(StorageReader):
    """Loads a DCP checkpoint that :class:`CkptdWriter` saved as a ckptd step.

    ``client_or_job`` and ``socket`` as for the writer (the client's rank does
    not matter: every saving rank's part is read by its number). The step comes
    from ``checkpoint_id``, else ``step``, else the newest step this node can
    restore — in a multi-process job give the step (every rank must load the
    same one). ``shared_memory``: have the daemon read each part into one of its
    verified shared-memory segments (else the files are mapped and checked here).
    ``_extension_registry`` (DCP's, for FileSystemReader's transformed streams) is
    accepted and unused: ckptd's writer applies no stream extensions.
    """

    def __init__(
        self,
        client_or_job: Client | str,
        step: int | None = None,
        *,
        socket: str | os.PathLike[str] | None = None,
        shared_memory: bool = True,
        client_options: dict[str, Any] | None = None,
        _extension_registry: Any = None,
    ) -> None:
        super().__init__()
        self._source = ClientSource(client_or_job, socket, None, client_options or {})
        self.load_id = uuid.uuid4().hex
        """Recorded in the metadata ``read_metadata`` returns (``storage_meta.load_id``)."""
        self.job = self._source.job
        self.step = None if step is None else parse_checkpoint_id(step, self.job)
        self.shared_memory = shared_memory
        self.storage_data: dict[Any, dict[str, Any]] = {}
        self._parts: dict[int, dict[str, np.ndarray]] = {}

    @property
    def checkpoint_id(self) -> str | None:
        """``ckptd://<job>/<step>`` of the load in progress."""
        return checkpoint_url(self.job, self.step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for ``ckptd://<job>/<step>`` and step numbers."""
        return is_checkpoint_id(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load begins; ``checkpoint_id`` (if given) names its step."""
        if checkpoint_id is not None:
            self.step = parse_checkpoint_id(checkpoint_id, self.job)
        self._parts = {}
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata, from the coordinator's part of the step."""
        if kwargs.get("rank") is not None:
            # DCP asks for rank-local metadata only after the global one failed;
            # ckptd never writes any, so the first error is the one to read.
            raise CheckpointNotFound(f"{self._what()} has no rank-local DCP metadata")
        client = self._source.get(world()[0], check=False)
        if self.step is None:
            steps = restorable_steps(client)
            if not steps:
                raise CheckpointNotFound(f"job {self.job!r} has no restorable step on this node")
            self.step = steps[0]
        part = self._part(COORDINATOR)
        if METADATA not in part:
            raise CheckpointNotFound(
                f"{self._what()} was not saved by ckptd's DCP writer (no DCP metadata in "
                "rank 0's part); restore it with Client.restore()"
            )
        md = decode_metadata(part[METADATA], self._what())
        if md.storage_meta is None:  # saved before the writer recorded it
            md.storage_meta = StorageMeta(checkpoint_id=self.checkpoint_id)
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Keep where each item was saved (its rank and key)."""
        self.storage_data = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy every planned item from the verified parts into its target."""
        by_rank: dict[int, list[ReadItem]] = defaultdict(list)
        for req in plan.items:
            loc = self.storage_data.get(req.storage_index)
            if not isinstance(loc, dict) or "rank" not in loc:
                raise CheckpointCorrupt(
                    f"{self._what()}: the DCP metadata has no location for {req.storage_index}"
                )
            by_rank[int(loc["rank"])].append(req)
        try:
            for rank in sorted(by_rank):
                items = self._part(rank).get(ITEMS, {})
                for req in by_rank[rank]:
                    self._read_one(req, items, planner)
                # Done with this part: its segment goes back once nothing views it.
                self._parts.pop(rank, None)
        finally:
            self._parts = {}
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_one(self, req: ReadItem, items: dict[str, np.ndarray], planner: LoadPlanner) -> None:
        loc = self.storage_data[req.storage_index]
        arr = items.get(loc["key"])
        if arr is None:
            raise CheckpointCorrupt(
                f"{self._what()}: rank {loc['rank']}'s part has no item {loc['key']!r}"
            )
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(arr.tobytes()))
            return
        src = narrow_tensor_by_index(
            to_tensor(arr, loc.get("dtype", "")), req.storage_offsets, req.lengths
        )
        target = planner.resolve_tensor(req).detach()
        if target.size() != src.size():
            raise InvalidArgument(
                f"{req.dest_index.fqn}: the load plan wants {tuple(target.size())} from a "
                f"saved block of {tuple(src.size())}"
            )
        with torch.no_grad():
            target.copy_(src)
        planner.commit_tensor(req, target)

    # -- parts -------------------------------------------------------------------
    def _what(self) -> str:
        return f"step {self.step} of job {self.job!r}"

    def _part(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s tree of the step, restored and verified (cached)."""
        part = self._parts.get(rank)
        if part is not None:
            return part
        client = self._source.get(world()[0], check=False)
        try:
            tree, _ = client.restore(self.step, shared_memory=self.shared_memory, rank=rank)
        except CheckpointNotFound as exc:
            tree = self._from_peers(client, rank, exc)
        if not isinstance(tree, dict):
            raise CheckpointCorrupt(f"{self._what()}: rank {rank}'s part is not a DCP part")
        self._parts[rank] = tree
        return tree

    def _from_peers(self, client: Client, rank: int, local: CheckpointNotFound) -> dict[str, Any]:
        """Rank ``rank``'s tree from another node's part, fetched from the bucket
        (``local``: why this node's daemon has none)."""
        assert self.step is not None
        try:
            peers = client.low_level.fetch_peers(self.step)
        except CheckpointNotFound:
            raise local from None  # the daemon knows no such step at all
        if not peers.parts:
            raise local  # no remote tier, or no other node saved the step
        for part in peers.parts:
            manifest = json.loads(part.manifest_json)
            if not any(r["rank"] == rank for r in manifest["ranks"]):
                continue

            opener = client.low_level.open_readable
            try:
                mm = mapped_views.map_file_verified(
                    part.directory, manifest, rank, opener, part=True
                )
            except mapped_views.Corrupt as exc:
                raise CheckpointCorrupt(f"{self._what()}: {exc}", "DATA_LOSS") from None
            tree, _ = mapped_views.build_tree(mm, manifest, rank)
            return tree  # type: ignore[no-any-return]
        raise CheckpointNotFound(
            f"{self._what()}: no part of rank {rank} on this node or in the bucket (is the "
            "step complete, and the daemon's remote tier configured?)"
        )

    def close(self) -> None:
        """Close the client this reader made (one given to it stays open)."""
        self._parts = {}
        self._source.close()
