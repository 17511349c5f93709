"""Shared-memory leases: named segments under /dev/shm, pre-faulted once, reused.

Segments are 0600 files in a 0700 directory of the daemon's (segments.py): only
the daemon opens them by name, and the one process a lease is granted to gets a
file descriptor over its session (api/access.py). A free segment is granted
again only to the uid it was granted to before.

Touching fresh memory is the slowest part of a save on these machines
(docs/architecture.md, "Performance notes"), so segments are allocated once, faulted in by
``posix_fallocate`` when created, and handed out again for later saves. The
total held is bounded by ``staging_budget_bytes``. Segments are mapped without
keeping a file descriptor (:mod:`.shm`), so a pool of many small segments never
runs into the process's fd limit.

A save lease stays granted from ``AcquireLease`` until its step is LOCAL or
FAILED (the saver releases it), so the journal's record of a handoff always
names a segment nobody else writes into. A lease the client never commits comes
back as soon as the client is gone: the client holds a shared flock on a small
liveness file for its whole life and names it when it asks for a lease
(:data:`HOLDER_HEADER`); no lock, no client. ``lease_timeout_seconds`` is only the
backstop for clients that name no such file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from ckptd.core.errors import Conflict, NotFound, ResourceExhausted
from ckptd.core.format import round_up

from .lease import Lease, Segment, segment_prefix
from .liveness import (
    SWEEP_SECONDS,
    check_holder,
    locked_by_others,
    sweep_dead_clients,
)
from .pool import SegmentPool
from .segments import (
    SEGMENT_GRANULE,
    SHM_DIR,
    open_trusted,
    remove_legacy,
    segment_dir,
)
from .share import held_by_uid, holders_text, over_share

__all__ = [
    "SEGMENT_GRANULE",
    "Lease",
    "Segment",
    "Staging",
    "StagingBusy",
    "segment_dir",
    "segment_prefix",
]

log = logging.getLogger("ckptd.staging")

KEPT_SUFFIX = ".kept"
"""The memory tier's record beside a segment it keeps (memory.py): what the segment
holds, so a daemon that restarts after a crash can serve it again."""


class StagingBusy(ResourceExhausted):
    """The budget is held by in-flight saves right now; waiting may help."""


class Staging(SegmentPool):
    """Lease pool with a byte budget. Methods run on the daemon's event loop."""

    def __init__(
        self,
        prefix: str,
        budget_bytes: int,
        lease_timeout_seconds: float,
        shm_dir: Path = SHM_DIR,
        clock: Callable[[], float] = time.monotonic,
        uid_of: Callable[[str], int | None] = lambda job: None,
        share_per_uid: float = 1.0,
    ) -> None:
        super().__init__(prefix, shm_dir)
        self.uid_of = uid_of
        """The uid owning a job (access.py): its leases reuse only its segments."""
        self.budget_bytes = budget_bytes
        self.lease_timeout_seconds = lease_timeout_seconds
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self.share_per_uid = share_per_uid
        """``staging_share_per_uid``: most of the budget one uid may hold (share.py)."""
        self._waiting: dict[int | None, int] = {}  # acquires waiting for memory, per uid
        self._freed = asyncio.Event()
        self._swept_at = clock()
        self.give_way: Callable[[int, int | None], Awaitable[None]] = _nothing
        """Called when a lease of ``need`` bytes for ``uid`` finds no free segment and no
        budget: the memory tier (memory.py) lets kept segments go, so a save never
        waits or fails because of it."""

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

    def remove_leftovers(self) -> int:
        """Delete segments a previous (crashed or older) daemon on this root left behind."""
        self.open()
        self.sweep_dead_clients()
        removed = remove_legacy(self.shm_dir, self.prefix)
        for path in self.dir.iterdir():
            if path.name.removesuffix(KEPT_SUFFIX) not in self._segments:
                with contextlib.suppress(IsADirectoryError, PermissionError):
                    path.unlink(missing_ok=True)
                    removed += 1
        return removed

    def close(self) -> None:
        """Unlink every segment, and unmap those no view uses any more."""
        for seg in list(self._segments.values()):
            self._destroy(seg)
        self._leases.clear()
        with contextlib.suppress(OSError):  # not empty (a leftover) or never made
            self.dir.rmdir()

    def adopt(self, name: str, lease_id: str, job: str, size: int | None = None) -> Lease:
        """Take over a segment a crashed daemon granted, for the journal's replay.

        ``size``: the segment's size as journaled. Raises SegmentRefused (a
        ValueError) if the file under that name is not one this daemon made
        (segments.py), FileNotFoundError if it is gone."""
        if not name.startswith(self.prefix) or "/" in name or name in (".", ".."):
            raise ValueError(f"segment {name!r} is not one of this root's")
        self.open()
        mapping = open_trusted(self.dir / name, size, legacy=self.shm_dir / name)
        seg = Segment(name, mapping.size, mapping)
        self._segments[name] = seg
        return self._grant(job, seg, lease_id=lease_id)

    # -- leases ------------------------------------------------------------
    def check_fits(self, size_bytes: int) -> int:
        """Segment size for ``size_bytes``; ResourceExhausted if the budget (or one
        uid's share of it) can never hold it."""
        need = round_up(max(size_bytes, 1), SEGMENT_GRANULE)
        if need > self.budget_bytes:
            raise ResourceExhausted(
                f"a save of {size_bytes} bytes does not fit the staging budget of "
                f"{self.budget_bytes} bytes; raise staging_budget_bytes "
                "(CKPTD_STAGING_BUDGET_BYTES)"
            )
        if need > self.budget_bytes * self.share_per_uid:
            raise ResourceExhausted(
                f"a save of {size_bytes} bytes does not fit one user's share of the staging "
                f"budget ({self.share_per_uid:g} of {self.budget_bytes} bytes); ask the "
                "operator to raise staging_share_per_uid or staging_budget_bytes"
            )
        return need

    def could_grant(self, size_bytes: int) -> bool:
        """Whether :meth:`acquire` would grant ``size_bytes`` now without waiting."""
        self.reclaim_expired()
        need = round_up(max(size_bytes, 1), SEGMENT_GRANULE)
        # Kept segments count as free: the memory tier gives them up for a save.
        free = [s for s in self._segments.values() if s.lease_id is None]
        if any(s.size >= need and not s.lent for s in free):
            return True
        return self.allocated_bytes - sum(s.size for s in free) + need <= self.budget_bytes

    async def acquire(
        self,
        job: str,
        size_bytes: int,
        restore: bool = False,
        wait_seconds: float = 0.0,
        holder: str = "",
        owner: tuple[int, int] | None = None,
        populate: bool = True,
    ) -> Lease:
        """Grant a lease of at least ``size_bytes``, reusing a free segment if one fits.

        ``restore``: a lease to fill with checkpoint data for the client (see
        :meth:`take_free`), allocated if no free segment fits. ``populate=False``: a
        new segment's pages are left for the caller to allocate as it fills them
        (:meth:`Segment.populate`; a download, so the first parts need not wait for
        the whole segment). ``wait_seconds``:
        while in-flight saves hold the budget, wait up to this long for them to
        finish (backpressure) before raising :class:`StagingBusy`. ``holder``: the
        client's liveness file; the lease comes back once it is no longer locked.
        ``owner``: the ``(uid, pid)`` the lease is granted to.
        """
        check_holder(holder)
        deadline = time.monotonic() + max(0.0, wait_seconds)
        uid = owner[0] if owner else self.uid_of(job)
        waiting = False
        try:
            while True:
                try:
                    return await self._acquire_now(
                        job, size_bytes, restore, holder, owner, populate
                    )
                except StagingBusy:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise
                    if not waiting:  # other uids leave it room while it waits (share.py)
                        self._waiting[uid] = self._waiting.get(uid, 0) + 1
                        waiting = True
                    # Leases of clients that died come back when their liveness lock is
                    # gone, which nothing signals: poll for those too.
                    freed = self._freed
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(freed.wait(), min(left, 0.5))
        finally:
            if waiting:
                self._waiting[uid] -= 1
                if not self._waiting[uid]:
                    del self._waiting[uid]

    async def _acquire_now(
        self,
        job: str,
        size_bytes: int,
        restore: bool,
        holder: str,
        owner: tuple[int, int] | None,
        populate: bool = True,
    ) -> Lease:
        self.reclaim_expired()
        need = self.check_fits(size_bytes)
        uid = owner[0] if owner else self.uid_of(job)
        held = held_by_uid(self._leases.values())
        why = over_share(uid, need, held, self._waiting, self.budget_bytes, self.share_per_uid)
        if why:
            raise StagingBusy(
                f"staging memory for {size_bytes} bytes must wait: {why}; "
                f"{self.holders(uid)}. Wait for earlier saves to reach LOCAL, or ask the "
                "operator to raise staging_budget_bytes"
            )
        free = sorted(self.free_segments(), key=lambda s: s.size)
        seg = next((s for s in free if s.size >= need and s.uid in (None, uid)), None)
        if seg is None and self.allocated_bytes + need > self.budget_bytes:
            await self.give_way(need, uid)  # the memory tier's segments go first
            free = sorted(self.free_segments(), key=lambda s: s.size)
            seg = next((s for s in free if s.size >= need and s.uid in (None, uid)), None)
        if seg is None:
            # Drop free segments another uid used, then those too small, until the new
            # one fits the budget.
            for small in sorted(free, key=lambda s: s.uid in (None, uid)):
                if self.allocated_bytes + need <= self.budget_bytes:
                    break
                self._destroy(small)
            if self.allocated_bytes + need > self.budget_bytes:
                raise StagingBusy(
                    f"staging budget exhausted: {size_bytes} bytes are needed and "
                    f"{self.in_use_bytes} of {self.budget_bytes} are held: "
                    f"{self.holders(uid)}; wait for earlier saves to reach LOCAL, or ask the "
                    "operator to raise staging_budget_bytes"
                )
            self._reserved += need
            try:
                seg = await asyncio.to_thread(self._create, need, populate)
            finally:
                self._reserved -= need
            self._segments[seg.name] = seg
        return self._grant(job, seg, restore, holder, owner=owner)

    def holders(self, uid: int | None) -> str:
        """What holds the leased memory right now, in words, as ``uid`` may see it
        (share.py: other users' jobs are never named)."""
        return holders_text(self._leases.values(), uid, self._clock())

    def _grant(
        self,
        job: str,
        seg: Segment,
        restore: bool = False,
        holder: str = "",
        lease_id: str = "",
        owner: tuple[int, int] | None = None,
    ) -> Lease:
        lease = Lease(
            lease_id or secrets.token_hex(12),
            job,
            seg,
            self._clock(),
            restore=restore,
            holder=holder,
            owner=owner,
        )
        seg.lease_id = lease.lease_id
        uid = owner[0] if owner is not None else self.uid_of(job)
        if uid is not None:  # never None again once someone could have mapped it
            seg.uid = uid
        self._leases[lease.lease_id] = lease
        return lease

    def take_free(self, job: str, size_bytes: int, uid: int | None = None) -> Lease | None:
        """A restore lease on an already faulted free segment, or None (never allocates).

        Takes a segment only if a save of the same size could still get memory
        while the restore holds it (another free segment, or budget to allocate
        one); once the client holds the lease the segment is its (:meth:`lend`).
        Only a segment ``uid`` (default: the job's owner) used before, or nobody
        did, is taken: the lease goes to one of its processes (:meth:`hold`).
        """
        self.reclaim_expired()
        uid = self.uid_of(job) if uid is None else uid
        free = sorted(
            (s for s in self.free_segments() if s.size >= size_bytes and s.uid in (None, uid)),
            key=lambda s: s.size,
        )
        if not free:
            return None
        need = round_up(max(size_bytes, 1), SEGMENT_GRANULE)
        if len(free) < 2 and self.allocated_bytes + need > self.budget_bytes:
            return None
        return self._grant(job, free[0], restore=True)

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
        if lease.shared and lease.segment.kept is not None:
            # The memory tier keeps it; the client's copy-on-write mapping shares its
            # pages until the tier lets it go (memory.py).
            lease.segment.lease_id = None
            return
        self._destroy(lease.segment)
        self._freed.set()  # the budget it held is free for saves waiting for memory
        self._freed = asyncio.Event()

    def grant_kept(self, job: str, seg: Segment) -> Lease:
        """A restore lease on a segment the memory tier keeps, shared: the client maps
        it copy-on-write and the segment is never granted for a save again."""
        seg.lent = True
        lease = self._grant(job, seg, restore=True)
        lease.shared = True
        return lease

    def keep(self, lease: Lease, key: tuple[str, int, int]) -> None:
        """End a committed save lease without freeing its segment: the memory tier
        keeps ``key``'s rank file in it (memory.py)."""
        if self._leases.pop(lease.lease_id, None) is not None:
            lease.segment.lease_id = None
            lease.segment.kept = key

    def adopt_kept(
        self, name: str, size: int, uid: int | None, key: tuple[str, int, int]
    ) -> Segment:
        """Take over a segment the memory tier of a crashed daemon kept (checked as
        :meth:`adopt` checks; raises the same)."""
        if not name.startswith(self.prefix) or "/" in name or name in (".", ".."):
            raise ValueError(f"segment {name!r} is not one of this root's")
        self.open()
        mapping = open_trusted(self.dir / name, size, legacy=self.shm_dir / name)
        seg = Segment(name, mapping.size, mapping, uid=uid, kept=key)
        self._segments[name] = seg
        return seg

    def let_go(self, seg: Segment) -> None:
        """The memory tier no longer keeps ``seg``: it is free for saves again, unless a
        restore mapped it and a process maps it still (then it leaves the pool and the
        budget: those pages are the trainer's now)."""
        seg.kept = None
        if seg.lease_id is not None:  # a restore lease not yet taken: it ends with it
            return
        if seg.lent and locked_by_others(self.dir / seg.name):
            self._destroy(seg)
        seg.lent = False
        self._freed.set()  # wake saves waiting for memory
        self._freed = asyncio.Event()

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
        lease.committed = True
        return lease

    def release(self, lease_id: str) -> None:
        """Return a lease to the pool (after its commit finished, or if the client gave up).
        A segment not allocated whole (a download that failed) is dropped instead."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            lease.segment.lease_id = None
            if lease.segment.kept is None and lease.segment.lent:
                self.let_go(lease.segment)  # let go while this restore lease was out
            elif not lease.segment.populated:
                self._destroy(lease.segment)
            self._freed.set()  # wake saves waiting for memory
            self._freed = asyncio.Event()

    def reclaim_expired(self) -> list[str]:
        """Return leases whose client died (its liveness file is unlocked) or that
        were held past the timeout without a commit."""
        now = self._clock()
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


async def _nothing(need: int, uid: int | None) -> None:
    """No memory tier: nothing to give up."""
