"""A lease and its segment: what the staging pool hands out (staging.py)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .segment_state import LENT, SegState
from .shm import SharedMapping


@dataclass
class Segment:
    """One shared-memory file mapped into the daemon. Who holds it (:attr:`state`, with
    :attr:`lease_id` and :attr:`kept`) changes only through segment_state.move."""

    name: str
    size: int
    mapping: SharedMapping
    state: SegState = SegState.NEW
    lease_id: str | None = None
    """The lease that holds it, in a state with a lease (segment_state.HAS_LEASE)."""
    uid: int | None = None
    """The uid whose processes were handed this segment: a process may keep its
    mapping, so the segment is never granted to another uid (access.py)."""
    populated: bool = True
    """Every page is allocated. A segment made for a download starts without (its
    pages are allocated chunk by chunk as the data arrives, :meth:`populate`), and
    goes back to the pool only once whole: a client writing into a page never
    allocated would die of SIGBUS if /dev/shm were full."""
    kept: tuple[str, int, int] | None = None
    """``(job, step, rank)`` whose committed rank file the memory tier keeps here
    (memory.py), in a kept state: not free for a lease until the tier lets it go."""
    image: tuple[str, int, int, str] | None = None
    """``(job, rank, step, holder)``: the segment holds, byte for byte, the lease of that
    rank's save of ``step`` that committed LOCAL, granted to the client whose liveness
    file is ``holder`` (a name no other process ever has), and nothing wrote into it
    since (a grant for anything that writes clears it)."""

    @property
    def lent(self) -> bool:
        """A restore may map it copy-on-write: never granted for a save again (the
        restored arrays would change under the trainer); the tier removes it when it
        lets it go, unless no process maps it any more."""
        return self.state in LENT

    def holds_image(self, image: tuple[str, int] | None, holder: str) -> bool:
        """Whether it holds the last committed image of ``image`` (``(job, rank)``)
        saved by the client ``holder``: no other process knows what that image holds."""
        tag = self.image
        return bool(image and holder and tag and tag[:2] == image and tag[3] == holder)

    def populate(self, offset: int = 0, length: int | None = None) -> None:
        """Allocate the pages of ``[offset, offset + length)`` (default: all); raises
        OSError if /dev/shm cannot hold them. Marks the segment whole when asked for
        all of it."""
        if self.populated:
            return
        self.mapping.populate(offset, self.size - offset if length is None else length)
        if offset == 0 and (length is None or length >= self.size):
            self.populated = True

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
    holder: str = ""
    """The client's liveness file (see :data:`HOLDER_HEADER`); empty: unknown client."""
    owner: tuple[int, int] | None = None
    """``(uid, pid)`` of the process the lease was granted to: only it may open the
    segment (None: nobody outside the daemon, e.g. a replayed handoff)."""
    shared: bool = False
    """A restore lease on a segment the memory tier keeps: the client gets a
    read-only descriptor and maps it copy-on-write; the segment stays the tier's."""
    holds: int | None = None
    """A save lease granted on a segment that holds this process's committed image of
    this step (:attr:`Segment.image`): unchanged shards need not be copied again."""
    reuses: bool = False
    """Asked for with ``reuse_image``: once committed, its image is worth keeping for
    the client's next save (a client that never asks has no use for it)."""


def segment_prefix(root: Path) -> str:
    """Segment-name prefix unique to a local-tier root, so daemons never clash."""
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    return f"ckptd-{digest}-"


@dataclass(frozen=True)
class Handed:
    """A restore's answer in shared memory: a verified lease holding a rank file's
    bytes from ``offset`` on (0: the whole file; else its data section)."""

    lease: Lease
    offset: int = 0


@dataclass(frozen=True)
class Want:
    """What a restore asks a tier for: ``rank``'s data (None: this node's own part,
    every rank of it), in shared memory if ``shared_memory`` and a segment is free,
    for a client of ``uid`` (a segment another uid mapped is never handed to it)."""

    rank: int | None
    shared_memory: bool = False
    uid: int | None = None
    copy_on_write: bool = False
    """The client maps a segment the memory tier keeps copy-on-write (memory.py)."""
    process: tuple[int, int] | None = None
    """The client's ``(uid, pid)``: the memory tier lends a segment whose writer
    lives only to that writer itself (memory.py)."""
