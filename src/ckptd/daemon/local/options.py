"""The local tier's settings: a typed, frozen group the composition root builds from
the daemon's configuration, so the tier never reads the configuration itself."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .admission import SpaceMark


@dataclass(frozen=True)
class LocalOptions:
    """What the local tier (the store, staging memory, the saver, admission) is
    configured with; each field names its configuration key."""

    root: Path
    """``root``: the local tier's directory."""
    node_id: str
    """``node_id``: this node's name in manifests."""
    staging_budget_bytes: int
    """``staging_budget_bytes``: most shared memory held in leases at once."""
    staging_share_per_uid: float
    """``staging_share_per_uid``: most of the budget one uid may hold."""
    memory_tier_steps: int
    """``memory_tier_steps``: newest steps per job kept in shared memory (0: off)."""
    memory_tier_bytes: int
    """``memory_tier_bytes``: most shared memory the memory tier keeps (0: the budget)."""
    lease_timeout_seconds: float
    """``lease_timeout_seconds``: an uncommitted lease held this long is reclaimed."""
    step_timeout_seconds: float
    """``step_timeout_seconds``: a step some of whose ranks never hand off fails then."""
    write_workers: int
    """``write_workers``: threads writing rank files."""
    io_nice: int
    """``io_nice``: the nice value of the I/O threads."""
    low_watermark: SpaceMark
    """``local_low_watermark``: below it, copies the bucket holds are evicted."""
    floor: SpaceMark
    """``local_floor``: a save that would go below it is refused."""
    incremental: bool = True
    """``incremental``: shards equal to the previous step's are referenced, not written."""
    incremental_max_files: int = 8
    """``incremental_max_files``: most rank files one rank's restore reads."""
    incremental_full_every: int = 0
    """``incremental_full_every``: every Nth save of a chain in full (0: never by count)."""
