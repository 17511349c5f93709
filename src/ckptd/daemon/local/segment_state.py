"""Who holds a shared-memory segment, and the only moves between holders.

A segment is memory a trainer may have mapped: granting it while someone else can
still write into it, or handing out one a restore still maps, corrupts a step with
no error. So its state is one value, :class:`SegState`, changed only by
:func:`move`, which refuses any move :data:`TRANSITIONS` does not list and logs each
one. The lending book (lending.py) is the only caller; staging.py decides *which*
segment moves, the memory tier (memory.py) *when* a kept one is let go.

The lease and the memory tier's key go with the state: a state that has a lease
(:data:`HAS_LEASE`) names one, a state that is kept (:data:`HAS_KEPT`) names the
``(job, step, rank)`` kept, every other state names neither, so the fields can never
disagree with the state.
"""

from __future__ import annotations

import enum
import logging
from typing import Protocol

log = logging.getLogger("ckptd.staging")


class SegState(enum.Enum):
    """Who holds a segment (docs/architecture.md, "Shared memory")."""

    NEW = "new"
    """Made, not yet in the pool (a spare being made, a crashed daemon's segment taken
    back)."""
    FREE = "free"
    """In the pool, grantable; it may hold a save's image for that client's next save."""
    SAVE = "save"
    """Granted to a client for a save: the client writes into it."""
    COMMITTING = "committing"
    """The save was handed off: the daemon owns its bytes until they are LOCAL."""
    RESTORE = "restore"
    """Granted for a restore (a verified read, a download, a pre-staged step): the
    daemon fills it, then the client maps it and it becomes the trainer's memory."""
    KEPT = "kept"
    """The memory tier keeps a committed rank file in it (memory.py)."""
    KEPT_SHARED = "kept-shared"
    """Kept, and a restore lease on it is out: the client maps it copy-on-write."""
    KEPT_LENT = "kept-lent"
    """Kept, and a restore may map it still: never granted for a save again; once let
    go it leaves the pool if a process maps it."""
    SHARED = "shared"
    """Let go by the memory tier while a restore lease on it was out: it goes when that
    lease does (back to the pool only if nobody maps it)."""
    GONE = "gone"
    """Unlinked; the daemon's mapping dropped (or dropped once no view of it is left)."""


S = SegState
TRANSITIONS: dict[SegState, frozenset[SegState]] = {
    S.NEW: frozenset({S.FREE, S.SAVE, S.KEPT_LENT, S.GONE}),
    S.FREE: frozenset({S.SAVE, S.RESTORE, S.GONE}),
    S.SAVE: frozenset({S.COMMITTING, S.FREE, S.GONE}),
    S.COMMITTING: frozenset({S.FREE, S.KEPT, S.GONE}),
    S.RESTORE: frozenset({S.FREE, S.GONE}),
    S.KEPT: frozenset({S.KEPT_SHARED, S.FREE, S.GONE}),
    S.KEPT_SHARED: frozenset({S.KEPT_LENT, S.SHARED, S.GONE}),
    S.KEPT_LENT: frozenset({S.KEPT_SHARED, S.FREE, S.GONE}),
    S.SHARED: frozenset({S.FREE, S.GONE}),
    S.GONE: frozenset(),
}
"""Every move a segment may make; anything else is a bug and raises."""

HAS_LEASE = frozenset({S.SAVE, S.COMMITTING, S.RESTORE, S.KEPT_SHARED, S.SHARED})
"""States in which one lease holds the segment."""
HAS_KEPT = frozenset({S.KEPT, S.KEPT_SHARED, S.KEPT_LENT})
"""States in which the memory tier keeps a rank file in the segment."""
LENT = frozenset({S.KEPT_SHARED, S.KEPT_LENT, S.SHARED})
"""States in which a restore may map the segment: never granted for a save again."""


class Held(Protocol):
    """What :func:`move` changes (lease.Segment)."""

    name: str
    state: SegState
    lease_id: str | None
    kept: tuple[str, int, int] | None


class IllegalMove(RuntimeError):
    """A segment was asked to make a move :data:`TRANSITIONS` does not list."""


def move(
    seg: Held,
    to: SegState,
    why: str,
    lease_id: str | None = None,
    kept: tuple[str, int, int] | None = None,
) -> None:
    """Move ``seg`` to ``to`` (``why``: the cause, logged). ``lease_id``: the lease a
    state with a lease gets (default: the one it has); ``kept``: the ``(job, step,
    rank)`` a kept state keeps (default: the one it keeps). Raises IllegalMove for a
    move not in :data:`TRANSITIONS`, or a lease or kept state left without its name."""
    came = seg.state
    if to not in TRANSITIONS[came]:
        raise IllegalMove(f"segment {seg.name}: {came.value} -> {to.value} is no move ({why})")
    lease = (lease_id or seg.lease_id) if to in HAS_LEASE else None
    key = (kept or seg.kept) if to in HAS_KEPT else None
    if (to in HAS_LEASE and lease is None) or (to in HAS_KEPT and key is None):
        raise IllegalMove(f"segment {seg.name}: {to.value} needs its lease or key ({why})")
    seg.state, seg.lease_id, seg.kept = to, lease, key
    log.debug("segment %s: %s -> %s (%s)", seg.name, came.value, to.value, why)
