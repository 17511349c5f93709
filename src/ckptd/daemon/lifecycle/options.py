"""The lifecycle's settings (retention, the drain, adoption): a typed, frozen group the
composition root builds from the daemon's configuration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..retention.policies import Policy


@dataclass(frozen=True)
class LifecycleOptions:
    """What moves steps between the tiers is configured with; each field names its
    configuration key."""

    retention_local: Policy
    """``retention_local``: which steps the local tier keeps."""
    retention_remote: Policy
    """``retention_remote``: which steps the bucket keeps (with a remote tier)."""
    evict_unuploaded: bool
    """``local_evict_unuploaded``: the local tier may evict steps not yet in the bucket."""
    drain_retry_max_seconds: float
    """``drain_retry_max_seconds``: the longest pause between upload attempts."""
    drain_stall_seconds: float
    """``drain_stall_seconds``: an upload moving no byte this long is retried."""
    adopt_poll_seconds: float
    """``adopt_poll_seconds``: how often watched directories are looked at."""
    adopt_dirs: tuple[Path, ...]
    """``adopt_dirs``: where adoption and put-back may act."""
