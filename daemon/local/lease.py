"""A lease and its segment: what the staging pool hands out (staging.py)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .shm import SharedMapping


@dataclass
class Segment:
    """One shared-memory file mapped into the daemon."""

    name: str
    size: int
    mapping: SharedMapping
    lease_id: str | None = None
    uid: int | None = None
    """The uid whose processes were handed this segment: a process may keep its
    mapping, so the segment is never granted to another uid (access.py)."""

    def view(self, offset: int, length: int) -> memoryview:
        """A zero-copy view of ``length`` bytes at ``offset``."""
        return self.mapping.view(offset, length)


@dataclass
class Lease:
    """A segment granted to one save of one rank."""

    lease_id: str
    job: str
    segment: Segment
    granted_at: float
    committed: bool = False
    restore: bool = False
    """A restore lease: holds verified checkpoint data for the client."""
    borrowed: bool = False
    """The client mapped the restore lease and flocks it while its arrays live."""
    holder: str = ""
    """The client's liveness file (see :data:`HOLDER_HEADER`); empty: unknown client."""
    owner: tuple[int, int] | None = None
    """``(uid, pid)`` of the process the lease was granted to: only it may open the
    segment (None: nobody outside the daemon, e.g. a replayed handoff)."""


def segment_prefix(root: Path) -> str:
    """Segment-name prefix unique to a local-tier root, so daemons never clash."""
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    return f"ckptd-{digest}-"
