"""A step and its lifecycle: the fields the catalog owns, the transition table, events."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptd.core import health
from ckptd.core.manifest import Manifest
from ckptd.core.timeline import Forks, timeline_at
from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import state_name

STAGING, LOCAL, DRAINING = pb.SAVE_STATE_STAGING, pb.SAVE_STATE_LOCAL, pb.SAVE_STATE_DRAINING
DURABLE, FAILED = pb.SAVE_STATE_DURABLE, pb.SAVE_STATE_FAILED
SUPERSEDED = pb.SAVE_STATE_SUPERSEDED
NEW = pb.SAVE_STATE_UNSPECIFIED
"""Not in the catalog (yet, or any more)."""

TRANSITIONS: Mapping[int, frozenset[int]] = {
    # A save or an adoption begins; a step found on disk at start-up; one only the
    # bucket holds.
    NEW: frozenset({STAGING, LOCAL, DURABLE}),
    # Committed locally; failed; an adoption that never committed is forgotten (NEW);
    # a newer save of the job was acknowledged before its write began (SUPERSEDED,
    # then forgotten: local/order.py).
    STAGING: frozenset({LOCAL, FAILED, SUPERSEDED, NEW}),
    # The drain takes it; a newer step went up instead; found complete in the bucket
    # at start-up; evicted (NEW) when no tier keeps it.
    LOCAL: frozenset({DRAINING, SUPERSEDED, DURABLE, NEW}),
    # Uploaded; put back in the queue (a newer step first, or the daemon stops);
    # failed for good.
    DRAINING: frozenset({DURABLE, LOCAL, FAILED}),
    # Retention removed the remote copy while the local one stays; no copy left.
    DURABLE: frozenset({SUPERSEDED, NEW}),
    # No copy left; a step a newer one references goes back in the queue (LOCAL):
    # the bucket needs it first (lifecycle/drain.py).
    SUPERSEDED: frozenset({NEW, LOCAL}),
    # Saved again under the same number (a new STAGING); no copy left; a failed
    # upload whose local copy is intact goes back in the queue (LOCAL).
    FAILED: frozenset({STAGING, NEW, LOCAL}),
}
"""Which lifecycle states may follow which. Anything else is a bug and raises."""


class IllegalTransition(RuntimeError):
    """A service asked for a transition the table does not allow (a bug in ckptd)."""


_FIELDS = frozenset(
    {
        "job",
        "step",
        "state",
        "error",
        "node_ranks",
        "world_size",
        "manifest",
        "milestone",
        "metrics",
        "created_unix",
        "handoff_at",
        "local_at",
        "durable_at",
        "remote_nodes",
        "replica_nodes",
        "memory_ranks",
        "peers",
        "pinned",
        "adopted",
        "busy",
        "evicting",
        "read_at",
        "changed",
        "unusable",
        "timeline",
        "forks",
        "abandoned",
        "holders",
    }
)


class Step:
    """One step of one job on this node. Read it anywhere; change it only through
    the :class:`Catalog` (assigning a field elsewhere raises ``AttributeError``)."""

    __slots__ = tuple(sorted(_FIELDS))

    job: str
    step: int
    state: int
    error: str
    node_ranks: tuple[int, ...]
    world_size: int
    manifest: Manifest | None
    """The local copy's manifest; None while the local tier holds no copy."""
    milestone: bool
    metrics: dict[str, float]
    created_unix: float
    """When the checkpoint was committed (the time retention policies see)."""
    handoff_at: float
    local_at: float
    durable_at: float
    remote_nodes: frozenset[str]
    """Nodes whose ``_complete`` marker for this step is in the bucket."""
    peers: frozenset[str]
    """Other nodes whose part of this step is fetched into ``<root>/.peers``."""
    replica_nodes: frozenset[str]
    """Peer daemons holding a replica of this node's part (the peer tier: a peer
    keeps the newest replica per job and source node, so only the newest step
    replicated has any)."""
    memory_ranks: frozenset[int]
    """This node's ranks whose rank file the memory tier keeps (local/memory.py)."""
    pinned: bool
    adopted: bool
    """An adopted directory tree (its remote layout differs: see remote/layout.py)."""
    busy: int
    """Operations reading a copy right now (a fetch); the evictor leaves it alone."""
    evicting: bool
    """The evictor is removing the local copy right now (a restore that chose it
    just before finds its files gone: an eviction, not corruption)."""
    read_at: float
    """time.monotonic() of the last Restore served from it."""
    changed: asyncio.Event
    unusable: str
    """Why no copy of this step verifies in any tier (restore skips it); empty if fine."""
    timeline: int
    """The job's timeline this step was saved on (core/timeline.py)."""
    forks: Forks
    """The job's lineage when it was saved (core/timeline.py)."""
    abandoned: bool
    """A later timeline forked at or below this step: not part of the job's live
    history (restore and retention's "newest" skip it; the catalog keeps it current)."""
    holders: frozenset[int]
    """The older steps whose rank files this step's references read, as the bucket's
    index says (the local copy's manifest says it too: :meth:`references`)."""

    def __init__(self, job: str, step: int, **values: Any) -> None:
        defaults: dict[str, Any] = {
            "state": NEW,
            "error": "",
            "node_ranks": (),
            "world_size": 1,
            "manifest": None,
            "milestone": False,
            "metrics": {},
            "created_unix": 0.0,
            "handoff_at": 0.0,
            "local_at": 0.0,
            "durable_at": 0.0,
            "remote_nodes": frozenset(),
            "replica_nodes": frozenset(),
            "memory_ranks": frozenset(),
            "peers": frozenset(),
            "pinned": False,
            "adopted": False,
            "busy": 0,
            "evicting": False,
            "read_at": -1e18,
            "changed": asyncio.Event(),
            "unusable": "",
            "timeline": 0,
            "forks": (),
            "abandoned": False,
            "holders": frozenset(),
        }
        for name, value in {"job": job, "step": step, **defaults, **values}.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"Step.{name} is owned by the Catalog: ask it for a transition instead"
        )

    def references(self) -> frozenset[int]:
        """The older steps whose rank files this step's references read (every tier
        that holds this step must hold them: daemon/retention/references.py)."""
        if self.manifest is not None:
            return frozenset(self.manifest.holders())
        return self.holders

    def reads(self) -> dict[int, int]:
        """:meth:`references` with each holder's timeline: the save under that number
        on this step's own history (a later timeline may have replaced it since)."""
        if self.manifest is not None:
            return self.manifest.holder_timelines()
        return {n: timeline_at(n, self.timeline, self.forks) for n in self.holders}

    def _set(self, **values: Any) -> None:
        for name, value in values.items():
            if name not in _FIELDS:
                raise AttributeError(f"Step has no field {name!r}")
            object.__setattr__(self, name, value)

    @property
    def key(self) -> tuple[str, int]:
        """``(job, step)``."""
        return self.job, self.step

    @property
    def order(self) -> tuple[bool, int, int]:
        """Sort key, oldest to newest save: abandoned steps before the live history,
        then by timeline and step (live steps: by step alone, the same order)."""
        return (not self.abandoned, self.timeline, self.step)

    @property
    def in_lineage(self) -> bool:
        """Counts for the job's timelines: a save in flight or a step with a copy
        somewhere (a save that failed with nothing kept does not)."""
        return self.state not in (FAILED, SUPERSEDED) or self.local or self.in_remote

    @property
    def local(self) -> bool:
        """The local tier holds a committed copy."""
        return self.manifest is not None

    @property
    def healthy(self) -> bool | None:
        """No NaN/Inf in this node's copy (True), some (False), not counted (None)."""
        return health.healthy(self.metrics)

    @property
    def in_remote(self) -> bool:
        """A complete copy (some node's part) is in the remote tier."""
        return self.state == DURABLE or bool(self.remote_nodes)

    @property
    def time(self) -> float:
        """The step's time for retention: committed, else handed off."""
        return self.created_unix or self.handoff_at

    def tiers(self) -> list[pb.Tier]:
        """The tiers holding a copy (``pb.Tier`` values)."""
        return (
            [pb.TIER_LOCAL] * self.local
            + [pb.TIER_REMOTE] * self.in_remote
            + [pb.TIER_PEER] * bool(self.replica_nodes)
        )

    @property
    def in_memory(self) -> bool:
        """Every rank of this node's part is kept in shared memory (the memory tier)."""
        m = self.manifest
        ranks = {r.rank for r in m.ranks} if m is not None else set(self.node_ranks)
        return bool(self.memory_ranks) and ranks <= self.memory_ranks

    def reached(self, target: int) -> bool:
        """Has the save reached ``target`` (LOCAL or DURABLE)?"""
        if target == LOCAL:
            return self.manifest is not None or self.local_at > 0
        return self.in_remote

    def final(self, target: int) -> bool:
        """Will it never reach ``target``?"""
        if self.reached(target):
            return False
        if target == LOCAL:  # failed, or a newer save was written instead
            return self.state in (FAILED, SUPERSEDED)
        # A FAILED upload with its local copy is tried again later (the drain).
        return self.state == SUPERSEDED or (self.state == FAILED and not self.local)

    def __repr__(self) -> str:
        return f"Step({self.job!r}, {self.step}, {state_name(self.state)})"


@dataclass(frozen=True)
class Event:
    """One transition of one step, as ``ListEvents`` and the metrics see it."""

    seq: int
    time: float
    kind: int
    """A ``pb.StepEvent`` value."""
    job: str
    step: int
    state: int
    """The step's state after the transition (UNSPECIFIED: it left the catalog)."""
    tiers: tuple[int, ...]
    detail: str = ""
    attributes: Mapping[str, str] = field(default_factory=dict)
