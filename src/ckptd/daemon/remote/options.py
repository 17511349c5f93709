"""The remote tier's configuration keys, declared here once (see local/options.py):
the bucket, how it is written and read, and the claim on the node's name there."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RemoteOptions:
    """What the remote tier (the bucket, uploads, ranged reads, the node claim) is
    configured with."""

    remote: str = ""
    """Remote tier: ``s3://BUCKET/PREFIX``, ``gs://BUCKET/PREFIX`` or ``file:///PATH``.
    Empty: local tier only (a warning at start-up)."""
    remote_endpoint_url: str = ""
    """Endpoint override for S3-compatible stores or the GCS emulator (else the
    standard AWS_ENDPOINT_URL_S3 / STORAGE_EMULATOR_HOST variables apply)."""
    drain_concurrency: int = 8
    """Parts uploaded (and ranged reads downloaded) in parallel."""
    part_size_bytes: int = 16 * 2**20
    """Size of one upload part / ranged read (S3 needs at least 5 MiB)."""
    remote_read_jitter_seconds: float = 0.0
    """Before its first read of the bucket for a job (at start-up, or a restore on a
    node that holds none of it), the daemon waits a random time up to this long, so a
    whole job restarting at once does not reach the bucket in the same second (0: no
    wait; docs/scale.md: nodes / 2,000 at 1,000 nodes and more)."""
    node_claim_heartbeat_seconds: float = 300.0
    """How often the daemon refreshes its claim on ``node_id`` in the bucket (one
    conditional PUT: docs/scale.md counts them)."""
    node_claim_stale_seconds: float = 900.0
    """A claim on the node name not refreshed for this long is taken over by another
    daemon with that name (a replacement node); must exceed the heartbeat."""
    node_claim_takeover: bool = False
    """Take the node name's claim at start-up even if another daemon's is fresh: for
    an operator who knows the old daemon is gone (its disk and host lost)."""
