"""The daemon's configuration keys: one frozen dataclass, each field a key with its
default and its documentation (the help and the configuration reference read them).

Apart from ``config.py`` (sources, parsing) and ``config_checks.py`` (checks across
keys), which both build on it.
"""

from __future__ import annotations

import re
import socket as _socket
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.core.wire import DEFAULT_SOCKET  # one default for both sides

from ..local.admission import SpaceMark
from ..retention.policies import Policy, parse_policy

DEFAULT_ROOT = "/var/lib/ckptd"
DEFAULT_METRICS_ADDRESS = "127.0.0.1:9464"


def _default_node_id() -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", _socket.gethostname()) or "node"
    return name.lstrip(".")[:63] or "node"


@dataclass(frozen=True)
class Config:
    """Everything ``ckptd serve`` needs; docs/reference/configuration.md is generated from it."""

    root: Path = Path(DEFAULT_ROOT)
    """Local tier directory (on NVMe). Holds ``<job>/<step>/`` and ``.staging``."""
    socket: Path = Path(DEFAULT_SOCKET)
    """Unix socket the gRPC API listens on (mode 0660)."""
    node_id: str = field(default_factory=_default_node_id)
    """This node's name in manifests and remote markers (defaults to the host name)."""
    staging_budget_bytes: int = 4 * 2**30
    """Most shared memory the daemon may hold in leases at once."""
    staging_share_per_uid: float = 1.0
    """Most of ``staging_budget_bytes`` one uid's leases may hold at once, as a
    fraction (above 0, at most 1; 1: no cap but the budget). Whatever the value,
    while another uid saves on the node (a live process of it asked for a save
    lease) or waits for staging memory, a uid already holding leases gets no new
    one past an even split of the budget among those uids; a uid alone may use
    the whole budget. Memory a uid took while alone stays its own until those
    saves end: set a share below 1 where users may hold leases on purpose."""
    memory_tier_steps: int = 1
    """Newest steps of each job kept in shared memory after they are LOCAL, so a
    trainer restarting on this node restores from memory, not from disk (0: off).
    Kept memory is part of ``staging_budget_bytes`` and is given back first when a
    save needs it."""
    memory_tier_bytes: int = 0
    """Most shared memory the memory tier keeps on this node, for all jobs (0: as
    much of ``staging_budget_bytes`` as saves leave free)."""
    incremental: bool = True
    """Incremental saves: a shard byte-identical to the job's previous step (the
    trainer's word that it did not change, or an equal SHA-256 digest, and always
    an equal crc32c) is not written or uploaded again; the step's manifest
    references the older step's bytes, and every tier keeps a step while a step it
    keeps references it. A client can turn it off per job (``incremental=False``)."""
    incremental_max_files: int = 8
    """Most rank files one rank's restore reads (its own and the older steps' its
    references point into); a save that would need more is written in full."""
    incremental_full_every: int = 0
    """Write every Nth save of a job's chain of incremental saves in full (0: only
    when ``incremental_max_files`` says so)."""
    lease_timeout_seconds: float = 600.0
    """A lease held this long without a commit is reclaimed (clients of this release
    are watched directly: their leases come back as soon as they exit)."""
    step_timeout_seconds: float = 600.0
    """A multi-rank step some of whose ranks never hand off fails after this long
    (counted from its first handoff, or from a restart that replayed it)."""
    write_workers: int = 2
    """Threads writing shard files to the local tier in parallel."""
    io_nice: int = 10
    """Nice value (0-19) of the daemon's write, read and checksum threads: they yield
    the host's cores to the trainer (0: the daemon's own priority)."""
    log_level: str = "info"
    """One of debug, info, warning, error."""
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
    drain_retry_max_seconds: float = 30.0
    """Longest pause between retries of a transient remote error (backoff doubles up to it);
    also the first pause before a failed upload is tried again (doubling to ten minutes)."""
    drain_stall_seconds: float = 45.0
    """An upload with no file finished for this long shows as the drain's error in
    status (a store that hangs without answering)."""
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
    retention_local: Policy = field(default_factory=lambda: parse_policy("KeepLatest(3)"))
    """Which checkpoints the local tier keeps (see daemon/retention/policies.py)."""
    retention_remote: Policy = field(
        default_factory=lambda: parse_policy("KeepAny([KeepLatest(3), KeepMilestones()])")
    )
    """Which checkpoints the remote tier keeps; milestones are always kept there."""
    local_evict_unuploaded: bool = False
    """Let the local retention evict a copy whose remote copy is not complete yet
    (milestones excepted). Off: such copies wait for the drain."""
    local_low_watermark: SpaceMark = field(default_factory=lambda: SpaceMark.parse("10%"))
    """Free space (bytes, '20GiB' or '10%' of the disk) below which the evictor also
    removes local copies the local policy keeps but the bucket holds, oldest first."""
    local_floor: SpaceMark = field(default_factory=lambda: SpaceMark.parse("1GiB"))
    """Free space a save must leave on the local disk; saves that would go below it
    are refused with RESOURCE_EXHAUSTED."""
    adopt_poll_seconds: float = 0.25
    """How often watched directories (a job's Orbax directory) are scanned for
    finished steps to adopt."""
    adopt_dirs: tuple[Path, ...] = ()
    """Directories (absolute; symlinks resolved at start-up) in which Adopt, Watch and
    EnsureLocal may act, on files the calling process could read or write itself.
    Empty: only each job's own Orbax directory under the root (``<root>/.orbax/<job>``)."""
    socket_group: str = ""
    """Group (name or gid) given to the socket, its session socket and its directory:
    the users who may call the daemon. Empty: the daemon's own group."""
    allow_uids: tuple[int, ...] = ()
    """Users (uids or names) who may use every job; a job otherwise belongs to the uid
    that first used it (root and the daemon's uid may use every job)."""
    allow_gids: tuple[int, ...] = ()
    """Groups (gids or names) whose members may use every job."""
    shared_jobs: tuple[str, ...] = ()
    """Job name patterns (fnmatch: ``team-*``) that anyone who reaches the socket may use."""
    sessions_per_uid: int = 0
    """Sessions (connected clients) one uid may hold at once; root and the daemon's
    uid are not counted. 0: three quarters of the daemon's session limit (a quarter
    of its fd limit), so one user cannot take every slot from the others while a
    single-user node keeps room for all its clients."""
    peer_address: str = "off"
    """``HOST:PORT`` (TCP) where the Peer service takes and serves replicas of other
    daemons' steps; ``off``: none (port 0: any free port, shown in status)."""
    peer_data_port: int = 0
    """TCP port (on ``peer_address``'s host) of the listener that serves replica bytes
    to restoring nodes (sendfile, ~3x gRPC's rate); 0: any free port, told to peers by
    the Peer service; -1: none (the bytes go through the Peer service: one port)."""
    peers: tuple[str, ...] = ()
    """The other daemons of the job, ``HOST:PORT`` each (a name resolving to several
    addresses, a Kubernetes headless Service's, counts each); this one is skipped."""
    peer_replicas: int = 1
    """How many peers get a replica of each job's newest local step."""
    peer_token_file: str = ""
    """File holding the token every daemon of the job shares; required with
    ``peer_address`` or ``peers`` (peer calls without it are refused)."""
    peer_tls_cert_file: str = ""
    """PEM certificate this daemon shows its peers; with ``peer_tls_key_file`` and
    ``peer_tls_ca_file``, peer traffic is mutual TLS (peer/tls.py). Empty: plain TCP."""
    peer_tls_key_file: str = ""
    """PEM private key of ``peer_tls_cert_file``."""
    peer_tls_ca_file: str = ""
    """PEM CA bundle the peers' certificates must chain to."""
    peer_tls_server_name: str = ""
    """Name every peer's certificate holds; empty: the host of its ``peers`` entry."""
    peer_identity: str = "auto"
    """How a replica's sender is proven to be the node it claims (peer/identity.py):
    ``certificate`` (its TLS certificate names the node), ``address`` (it sends from
    that node's ``peers`` address); ``auto``: certificate with the peer_tls_* files
    unless ``peer_tls_server_name`` is set (one certificate shared by every node)."""
    peer_bandwidth_bytes: int = 512 * 2**20
    """Bytes per second replication may send (saves and the drain keep the rest)."""
    peer_max_lag_seconds: float = 30.0
    """Replication yields to saves being written (STAGING), but once a job's replica
    has been behind its newest local step this long it sends regardless (a continuous
    save loop leaves no gap; the replica is the node-loss copy)."""
    peer_budget_bytes: int = 64 * 2**30
    """Disk this daemon gives to replicas of other nodes' steps."""
    peer_bulk_deadline_seconds: float = 120.0
    """Seconds one request to the bulk data listener may take from its connection, a
    ranged read's bytes included (a caller that trickles is cut there); a caller has
    at most 5 s of it to show the token."""
    peer_idle_seconds: float = 300.0
    """Seconds a replica being received may go without a byte before it is dropped
    with its share of ``peer_budget_bytes``; more than ``peer_max_lag_seconds`` (a
    sender pauses for its node's saves that long)."""
    metrics_address: str = DEFAULT_METRICS_ADDRESS
    """``HOST:PORT`` of the HTTP endpoint with ``/metrics`` (Prometheus), ``/healthz`` and
    ``/readyz``; ``off`` to serve none. Port 0 picks a free port (shown in status). If
    the default port is taken (another daemon on this host) the daemon starts without
    it and says so; an address set explicitly must be free."""
    metrics_job_labels: str = "auto"
    """Whether ``/metrics`` series carry job names (anyone reaching the port reads
    them): ``on``; ``off`` (exposure per tier only, the worst running job's); ``auto``:
    on unless jobs of several uids use this daemon or ``allow_uids``, ``allow_gids``
    or ``shared_jobs`` is set."""
