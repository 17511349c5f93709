"""The leases of a staging pool: granted, held, lent, kept, released, reclaimed.

The bookkeeping half of staging (staging.py decides what to grant under the
budget): every lease granted and to whom, the segments the memory tier keeps
(memory.py), and the leases that come back on their own when the client that
held them is gone (its liveness file unlocked: liveness.py) or, for clients
naming no such file, after ``lease_timeout_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from ckptd.core.errors import Conflict, NotFound

from .lease import Lease, Segment
from .liveness import SWEEP_SECONDS, check_holder, locked_by_others, sweep_dead_clients
from .pool import SegmentPool
from .segment_state import HAS_KEPT, IllegalMove, SegState, move
from .segments import open_trusted

log = logging.getLogger("ckptd.staging")


class Lending(SegmentPool):
    """Leases over a pool's segments. Methods run on the daemon's event loop."""

    def __init__(
        self,
        prefix: str,
        shm_dir: Path,
        lease_timeout_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        uid_of: Callable[[str], int | None] = lambda job: None,
        record: Path | None = None,
    ) -> None:
        super().__init__(prefix, shm_dir, record)
        self.uid_of = uid_of
        """The uid owning a job (access.py): its leases reuse only its segments."""
        self.lease_timeout_seconds = lease_timeout_seconds
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._freed = asyncio.Event()
        self._swept_at = clock()

    def _wake(self) -> None:
        """Memory came back: wake the saves waiting for it."""
        self._freed.set()
        self._freed = asyncio.Event()

    # -- accounting --------------------------------------------------------
    @property
    def in_use_bytes(self) -> int:
        """Shared memory in leases (held by clients or being written)."""
        return sum(s.size for s in self._segments.values() if s.lease_id is not None)

    @property
    def kept_bytes(self) -> int:
        """Shared memory the memory tier keeps committed rank files in (memory.py)."""
        return sum(s.size for s in self._segments.values() if s.kept is not None)

    def free_segments(self) -> list[Segment]:
        """Segments no lease holds and the memory tier does not keep."""
        return [s for s in self._segments.values() if s.lease_id is None and s.kept is None]

    @property
    def committed_bytes(self) -> int:
        """Shared memory of saves handed off and not yet written to disk."""
        return sum(lease.segment.size for lease in self._leases.values() if lease.committed)

    @property
    def leases_held(self) -> int:
        """Leases granted and not yet returned to the pool."""
        return len(self._leases)

    # -- lifecycle ---------------------------------------------------------
    def sweep_dead_clients(self) -> int:
        """Remove liveness files of clients that died (nobody holds their lock)."""
        self._swept_at = self._clock()
        return sweep_dead_clients(self.shm_dir)

    def _grant(
        self,
        job: str,
        seg: Segment,
        restore: bool = False,
        holder: str = "",
        lease_id: str = "",
        owner: tuple[int, int] | None = None,
        image: tuple[str, int] | None = None,
    ) -> Lease:
        """Grant ``seg``. Whatever the lease is for may write into the segment, so the
        image it held is forgotten; ``image``: the ``(job, rank)`` of a save that would
        reuse it, told (:attr:`Lease.holds`) when the image is that very process's."""
        tag = seg.image if seg.holds_image(image, holder) else None
        lease_id = lease_id or secrets.token_hex(12)
        to = SegState.RESTORE if restore else SegState.SAVE
        move(seg, to, f"granted to job {job}", lease_id=lease_id)  # first: it may refuse
        seg.image = None
        lease = self._lease(job, seg, restore, holder, lease_id, owner)
        lease.reuses = image is not None
        if tag is not None:
            lease.holds = tag[2]
        return lease

    def _lease(
        self,
        job: str,
        seg: Segment,
        restore: bool,
        holder: str,
        lease_id: str,
        owner: tuple[int, int] | None = None,
    ) -> Lease:
        """A new lease on ``seg``, in the book (the caller has moved the segment)."""
        lease = Lease(
            lease_id,
            job,
            seg,
            self._clock(),
            restore=restore,
            holder=holder,
            owner=owner,
        )
        uid = owner[0] if owner is not None else self.uid_of(job)
        if uid is not None:  # never None again once someone could have mapped it
            seg.uid = uid
        self._leases[lease.lease_id] = lease
        return lease

    def hold(self, lease: Lease, holder: str, owner: tuple[int, int] | None) -> bool:
        """The client ``holder`` (process ``owner``) receives this (restore) lease: it
        comes back at once if that client dies before it maps and locks the segment.
        False (and the lease released) if another uid used the segment before."""
        check_holder(holder)
        if owner is not None and lease.segment.uid not in (None, owner[0]):
            self.release(lease.lease_id)
            return False
        lease.holder, lease.owner = holder, owner
        if owner is not None:
            lease.segment.uid = owner[0]
        return True

    def holds(self, lease: Lease) -> bool:
        """Whether ``lease`` is still granted (not expired and reclaimed)."""
        return self._leases.get(lease.lease_id) is lease

    def lend(self, lease_id: str) -> None:
        """The client mapped a restore lease and holds it: the segment becomes the
        trainer's memory. It leaves the pool and the budget (unlinked, the daemon's
        mapping dropped), so restored arrays a trainer keeps for its whole run (an
        optimizer's state) never hold staging memory; the pages go when the
        trainer's last view of them does."""
        lease = self.get(lease_id)
        if not lease.restore:
            raise Conflict(
                f"lease {lease_id!r} is not a restore lease; only those can be held by the client"
            )
        del self._leases[lease_id]
        if lease.segment.state is SegState.KEPT_SHARED:
            # The memory tier keeps it; the client's copy-on-write mapping shares its
            # pages until the tier lets it go (memory.py).
            move(lease.segment, SegState.KEPT_LENT, f"lease {lease_id} mapped by its client")
            self._left_service(lease.segment)
            return
        self._destroy(lease.segment, f"lease {lease_id} mapped by its client: its memory now")
        self._wake()  # the budget it held is free for saves waiting for memory

    def grant_kept(self, job: str, seg: Segment) -> Lease:
        """A restore lease on a segment the memory tier keeps, shared: the client maps
        it copy-on-write and the segment is never granted for a save again."""
        lease_id = secrets.token_hex(12)
        move(seg, SegState.KEPT_SHARED, f"shared with a restore of job {job}", lease_id)
        # The image stays: a copy-on-write mapping of a read-only descriptor cannot
        # change it.
        lease = self._lease(job, seg, True, "", lease_id)
        lease.shared = True
        return lease

    def keep(self, lease: Lease, key: tuple[str, int, int]) -> bool:
        """End a committed save lease without freeing its segment: the memory tier
        keeps ``key``'s rank file in it (memory.py). False: the lease was not held any
        more (the pool stopped), nothing is kept."""
        if self._leases.get(lease.lease_id) is not lease:
            return False
        move(lease.segment, SegState.KEPT, "kept by the memory tier", kept=key)
        del self._leases[lease.lease_id]
        self._left_service(lease.segment)
        return True

    def adopt_kept(
        self, name: str, size: int, uid: int | None, key: tuple[str, int, int]
    ) -> Segment:
        """Take over a segment the memory tier of a crashed daemon kept (checked as
        :meth:`adopt` checks; raises the same). It is lent: a trainer the last daemon
        restored from it may map it still, so when the tier lets it go it goes back
        to the pool only if nobody maps it (else a save would write under that
        trainer's restored arrays)."""
        if not name.startswith(self.prefix) or "/" in name or name in (".", ".."):
            raise ValueError(f"segment {name!r} is not one of this root's")
        self.open()
        mapping = open_trusted(self.dir / name, size, legacy=self.shm_dir / name)
        seg = Segment(name, mapping.size, mapping, uid=uid)
        move(seg, SegState.KEPT_LENT, "kept by the last daemon's memory tier", kept=key)
        self._segments[name] = seg
        return seg

    def let_go(self, seg: Segment) -> None:
        """The memory tier no longer keeps ``seg``: it is free for saves again, unless a
        restore mapped it and a process maps it still (then it leaves the pool and the
        budget: those pages are the trainer's now)."""
        if seg.state is SegState.GONE:
            return  # removed with the pool at stop while a check of it ran
        if seg.state not in HAS_KEPT:  # letting go twice could free a segment a lease holds
            raise IllegalMove(f"segment {seg.name} is {seg.state.value}, not kept: not let go")
        if seg.state is SegState.KEPT_SHARED:  # a restore lease not yet taken: it ends with it
            move(seg, SegState.SHARED, "let go by the memory tier, a restore lease out")
            return
        if seg.lent and locked_by_others(self.dir / seg.name):
            self._destroy(seg, "let go by the memory tier, a restore maps it: the trainer's")
            self._left_service(seg)
        else:
            move(seg, SegState.FREE, "let go by the memory tier")
        self._wake()

    def saves_in_flight(self, size: int) -> bool:
        """Whether a save lease holds a segment of at least ``size`` bytes (it goes
        back into the saves' rotation once that save is in), or a lease's segment of
        that size is being made (spares.py)."""
        if self.making_own(size):
            return True
        return any(not x.restore and x.segment.size >= size for x in self._leases.values())

    def making_own(self, size: int) -> bool:
        """Whether a lease is having a segment of at least ``size`` bytes made now."""
        return self._reserved >= size

    def _left_service(self, seg: Segment) -> None:
        """``seg`` no longer serves saves (a trainer maps it, or the memory tier keeps
        it): staging may prepare a spare of its size (spares.py)."""

    def get(self, lease_id: str) -> Lease:
        """The live lease with this id, or NotFound."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise NotFound(
                f"unknown lease {lease_id[:40]!r}: it was never granted, was already committed, "
                "or expired after lease_timeout_seconds; acquire a new lease"
            )
        return lease

    def begin_commit(self, lease_id: str) -> Lease:
        """Mark a lease as handed off: from now on the daemon owns its bytes."""
        lease = self.get(lease_id)
        if lease.committed:
            raise Conflict(f"lease {lease_id!r} was already committed; acquire a new lease")
        move(lease.segment, SegState.COMMITTING, f"lease {lease_id} handed off")
        lease.committed = True
        return lease

    def release(self, lease_id: str) -> None:
        """Return a lease to the pool (after its commit finished, or if the client gave up).
        A segment not allocated whole (a download that failed) is dropped instead."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        seg, why = lease.segment, f"lease {lease_id} released"
        if seg.state is SegState.KEPT_SHARED:  # the memory tier keeps it still
            move(seg, SegState.KEPT_LENT, why)
        elif seg.state is SegState.SHARED:  # let go while this restore lease was out
            if locked_by_others(self.dir / seg.name):
                self._destroy(seg, f"{why}, a restore maps it: the trainer's")
                self._left_service(seg)
            else:
                move(seg, SegState.FREE, why)
        elif not seg.populated:
            self._destroy(seg, f"{why}, never allocated whole")
        else:
            move(seg, SegState.FREE, why)
        self._wake()

    def reclaim_expired(self) -> list[str]:
        """Return leases whose client died (its liveness file is unlocked) or that
        were held past the timeout without a commit."""
        now = self._clock()
        self._unmap_later()
        if now - self._swept_at > SWEEP_SECONDS:
            self.sweep_dead_clients()
        expired = []
        dead: dict[str, bool] = {}
        for lid, lease in list(self._leases.items()):
            if lease.committed:
                continue
            if lease.holder:
                if lease.holder not in dead:
                    dead[lease.holder] = not locked_by_others(self.shm_dir / lease.holder)
                if dead[lease.holder]:
                    log.warning(
                        "lease %s of job %s reclaimed: its client exited without committing",
                        lid,
                        lease.job,
                    )
                    expired.append(lid)
                # A live client keeps its lease however slow it is (a device copy):
                # taking it back could let two writers share a segment.
                continue
            if now - lease.granted_at > self.lease_timeout_seconds:
                log.warning("lease %s for job %s expired without a commit", lid, lease.job)
                expired.append(lid)
        for lid in expired:
            self.release(lid)
        for holder, gone in dead.items():
            if gone:  # a crashed client leaves its file behind; tidy it if we may
                with contextlib.suppress(OSError):
                    (self.shm_dir / holder).unlink()
        return expired

    def owned_by(self, owner: tuple[int, int]) -> list[str]:
        """The uncommitted leases granted to process ``owner`` (``(uid, pid)``)."""
        return [i for i, le in self._leases.items() if le.owner == owner and not le.committed]
