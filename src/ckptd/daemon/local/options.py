"""The local tier's configuration keys, declared here once: each field is a key of
``ckptd serve`` (config file, ``CKPTD_*``, flag) with its default and its
documentation; app/config_fields.py composes every tier's keys into the flat
configuration, and the help and the configuration reference are generated from
these declarations. The composition root hands the tier its own group."""

from __future__ import annotations

import re
import socket as _socket
from dataclasses import dataclass, field
from pathlib import Path

from .admission import SpaceMark

DEFAULT_ROOT = "/var/lib/ckptd"


def _default_node_id() -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", _socket.gethostname()) or "node"
    return name.lstrip(".")[:63] or "node"


@dataclass(frozen=True)
class LocalOptions:
    """What the local tier (the store, staging memory, the memory tier, the saver,
    admission) is configured with."""

    root: Path = Path(DEFAULT_ROOT)
    """Local tier directory (on NVMe). Holds ``<job>/<step>/`` and ``.staging``."""
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
    supersede_unwritten: bool = True
    """When a job's saves arrive faster than the local disk writes them, a save whose
    write has not begun, of a client that asked for it (``Client(supersede=True)``,
    or a policy saving every step), is not written once a newer save of the job is
    acknowledged (it ends SUPERSEDED): the disk writes the newest save it can and the
    trainer never waits for it while the staging budget has room. Milestones, and
    saves that start a new timeline, are always written. False: every acknowledged
    save is written, in order, whatever the client asked."""
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
    local_low_watermark: SpaceMark = field(default_factory=lambda: SpaceMark.parse("10%"))
    """Free space (bytes, '20GiB' or '10%' of the disk) below which the evictor also
    removes local copies the local policy keeps but the bucket holds, oldest first."""
    local_floor: SpaceMark = field(default_factory=lambda: SpaceMark.parse("1GiB"))
    """Free space a save must leave on the local disk; saves that would go below it
    are refused with RESOURCE_EXHAUSTED."""
