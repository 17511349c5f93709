"""A save in progress as the saver sees it: the validated request (checked against
its lease, and against the save it joins), and a step's ranks handed off so far."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ckptd.core.errors import Conflict, InvalidArgument
from ckptd.core.format import ALIGN, round_up
from ckptd.core.health import NONFINITE_METRIC
from ckptd.core.manifest import DATA_TIMELINE, Manifest, RankRecord
from ckptd.core.shard_table import ShardTable

from ..catalog import Step
from ..commit import RenameCommit
from .staging import Lease


@dataclass(frozen=True)
class CommitRequest:
    """A validated ``CommitShardsRequest`` (api/requests.py builds it)."""

    lease_id: str
    job: str
    step: int
    rank: int
    node_ranks: tuple[int, ...]
    world_size: int
    data_offset: int
    table: ShardTable
    """The rank's shards, checked (offsets from ``data_offset`` in the lease)."""
    tree: Any
    metadata: dict[str, Any]
    milestone: bool
    metrics: dict[str, float]
    incremental: bool = False
    """Shards equal to the previous step's are referenced, not written (core/increments.py)."""
    unchanged_since: int = 0
    unchanged: npt.NDArray[np.bool_] | None = None
    """Per row of ``table``: the trainer's word that it did not change since step
    ``unchanged_since`` (None: no word, compare digests)."""
    copied_nonce: int = 0
    copied_at: int = 0
    copied_holder: str = ""
    copied_process: tuple[int, int] = (0, 0)
    """Sent while the client still copies: the rank's write waits for its word while
    that client lives (copied.py): its liveness file, ``(pid, start time)``."""
    supersede: bool = False
    """A newer save of the job may take its place before its write begins (order.py)."""


def check_lease(req: CommitRequest, lease: Lease) -> int:
    """The length of ``req``'s data section, once checked against ``lease`` (granted to
    its job for a save, not committed yet, large enough); InvalidArgument or Conflict
    saying what to do otherwise."""
    if lease.job != req.job:
        raise InvalidArgument(
            f"lease {req.lease_id!r} was granted to job {lease.job!r}, not {req.job!r}"
        )
    if lease.committed:
        raise Conflict(f"lease {req.lease_id!r} was already committed; acquire a new lease")
    if lease.restore:
        raise InvalidArgument(
            f"lease {req.lease_id!r} holds restored data; acquire a save lease instead"
        )
    data_len = req.table.check_layout()
    if req.data_offset % ALIGN or req.data_offset + round_up(data_len) > lease.segment.size:
        raise InvalidArgument(
            f"shards span bytes {req.data_offset}..{req.data_offset + data_len} but lease "
            f"{req.lease_id!r} holds {lease.segment.size} bytes (data_offset must be a "
            f"multiple of {ALIGN}); acquire a lease large enough for the save"
        )
    return data_len


@dataclass
class PendingStep:
    """A save being written: its staging directory and the ranks handed off so far."""

    step: Step
    commit: RenameCommit
    ticket: int
    """The step's place in the I/O queue (IoPool.ticket): older saves' work goes first."""
    ranks: dict[int, tuple[RankRecord, ShardTable, dict[str, Any]]] = field(default_factory=dict)
    nonfinite: dict[int, dict[str, int]] = field(default_factory=dict)
    """Each written rank's shards holding NaN/Inf, with their counts (core/health.py)."""
    writing: set[int] = field(default_factory=set)
    leases: dict[int, Lease] = field(default_factory=dict)
    """Each handed-off rank's lease, held until the step is LOCAL or FAILED."""
    images: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """Each written rank whose data section starts its lease: ``(header length,
    header crc32c, data length)``, for the memory tier (memory.py)."""
    timer: asyncio.TimerHandle | None = None
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the step is LOCAL or ended: newer saves of the job commit after that."""
    replaces: Step | None = None
    """The step this save replaces (core/timeline.py), until its local copy is gone."""
    base: Step | None = None
    """The step this save's rank files may reference (local/increment.py)."""
    holds: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    """The base held (``Catalog.in_use``) until this step is LOCAL or FAILED."""
    increment: int = 0
    """The manifest's ``increment``: 0 unless a rank file references an older step."""
    copied: set[int] = field(default_factory=set)
    """Ranks whose bytes are in the lease (the trainer's copy done: copied.py)."""
    started: bool = False
    """Its write had its turn (order.py): no newer save can take its place now."""
    superseded: bool = False
    """A newer save of the job took its place before its write began (order.py)."""
    supersedable: bool = True
    """Every rank that handed off allows it (``CommitRequest.supersede``)."""

    def handed_off(self) -> bool:
        """Every rank of the node has handed its shards over (some may still be writing)."""
        return set(self.step.node_ranks) <= set(self.ranks) | self.writing


def step_manifest(pending: PendingStep, node_id: str) -> Manifest:
    """The manifest of a save whose every rank is written."""
    st = pending.step
    ranks = [pending.ranks[r] for r in sorted(pending.ranks)]
    nonfinite = {str(r): pending.nonfinite.get(r, {}) for r in sorted(pending.ranks)}
    # The daemon's own metric: the step's health, wherever its metrics go.
    total = sum(sum(counts.values()) for counts in nonfinite.values())
    return Manifest(
        job=st.job,
        step=st.step,
        node=node_id,
        world_size=st.world_size,
        created_unix=time.time(),
        ranks=[r for r, _, _ in ranks],
        shards=ShardTable.concat([shards for _, shards, _ in ranks]),
        metadata=next((m for _, _, m in ranks if m), {}),
        milestone=st.milestone,
        metrics={**st.metrics, NONFINITE_METRIC: float(total)},
        nonfinite=nonfinite,
        data_layout=DATA_TIMELINE,  # where the drain will put its rank files
        timeline=st.timeline,
        forks=st.forks,
        increment=pending.increment,
    )


def check_join(st: Step, pending: PendingStep | None, req: CommitRequest, settling: bool) -> None:
    """Another rank of ``st``, a save in progress under the same number, hands off:
    Conflict or InvalidArgument, saying what to do, unless it may join
    (``settling``: every rank of the step committed, its last work winding down)."""
    if pending is None and settling:
        raise Conflict(
            f"step {req.step} of job {req.job!r} is already committed by all its "
            "ranks; save under a new step number"
        )
    if pending is None or pending.step is not st:
        raise Conflict(
            f"step {req.step} of job {req.job!r} is being adopted here; save under a "
            "new step number"
        )
    if st.node_ranks != req.node_ranks:
        raise InvalidArgument(
            f"rank {req.rank} names node ranks {list(req.node_ranks)} but step "
            f"{req.step} was started with {list(st.node_ranks)}; every rank must pass "
            "the same node_ranks"
        )
    if req.rank in pending.ranks or req.rank in pending.writing:
        raise Conflict(f"rank {req.rank} already committed step {req.step} of job {req.job!r}")
