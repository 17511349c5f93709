"""The remote tier's settings: a typed, frozen group the composition root builds from
the daemon's configuration, so the tier never reads the configuration itself."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RemoteOptions:
    """What the bucket tier (the backend, the node's index and its claim) is
    configured with; each field names its configuration key."""

    url: str = ""
    """``remote``: the bucket URL; empty: no remote tier."""
    endpoint_url: str = ""
    """``remote_endpoint_url``: an S3-compatible endpoint."""
    concurrency: int = 8
    """``drain_concurrency``: parts in flight per transfer."""
    part_size_bytes: int = 16 * 2**20
    """``part_size_bytes``: the size of one part of an upload or a ranged download."""
    read_jitter_seconds: float = 0.0
    """``remote_read_jitter_seconds``: spreads the nodes' first reads of the bucket."""
    claim_heartbeat_seconds: float = 300.0
    """``node_claim_heartbeat_seconds``: how often the node name's claim is renewed."""
    claim_stale_seconds: float = 900.0
    """``node_claim_stale_seconds``: a claim not renewed this long may be taken over."""
    claim_takeover: bool = False
    """``node_claim_takeover``: take the node name from a daemon still holding it."""
