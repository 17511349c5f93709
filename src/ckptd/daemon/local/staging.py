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
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from ckptd.core.errors import ResourceExhausted, Unavailable
from ckptd.core.format import round_up

from .lease import Lease, Segment, segment_prefix
from .lending import Lending
from .liveness import (
    check_holder,
)
from .room import Room
from .segment_state import SegState, move
from .segments import (
    SEGMENT_GRANULE,
    SHM_DIR,
    open_trusted,
    recorded_dir,
    remove_legacy,
)
from .share import held_by_uid, holders_text, over_share
from .spares import SpareSegments

__all__ = [
    "SEGMENT_GRANULE",
    "Lease",
    "Segment",
    "Staging",
    "StagingBusy",
    "Stopping",
    "recorded_dir",
    "segment_prefix",
]

log = logging.getLogger("ckptd.staging")

KEPT_SUFFIX = ".kept"
"""The memory tier's record beside a segment it keeps (memory.py): what the segment
holds, so a daemon that restarts after a crash can serve it again."""


class StagingBusy(ResourceExhausted):
    """The budget is held by in-flight saves right now; waiting may help."""


class Stopping(Unavailable):
    """The daemon is stopping: it makes no shared memory any more (the client asks the
    next daemon)."""


class Staging(Lending):
    """Lease pool with a byte budget: what to grant (the leases' bookkeeping is
    lending.py's). Methods run on the daemon's event loop."""

    def __init__(
        self,
        prefix: str,
        budget_bytes: int,
        lease_timeout_seconds: float,
        shm_dir: Path = SHM_DIR,
        clock: Callable[[], float] = time.monotonic,
        uid_of: Callable[[str], int | None] = lambda job: None,
        share_per_uid: float = 1.0,
        record: Path | None = None,
        room: Room | None = None,
    ) -> None:
        super().__init__(prefix, shm_dir, lease_timeout_seconds, clock, uid_of, record)
        self.budget_bytes = budget_bytes
        self.share_per_uid = share_per_uid
        """``staging_share_per_uid``: most of the budget one uid may hold (share.py)."""
        self._waiting: dict[int | None, int] = {}  # acquires waiting for memory, per uid
        self._savers: set[tuple[int, int]] = set()
        """Live processes ``(uid, pid)`` that asked for a save lease: their uids have
        a fair part of the budget kept for them (share.py) until :meth:`process_gone`."""
        self._room = room if room is not None else Room()
        """Asked when a lease finds no free segment and no budget (``give_way``), or the
        shm filesystem cannot hold a new segment (``shed``): the memory tier lets kept
        segments go (room.py), so a save never waits or fails because of them."""
        self.segments_created = 0
        """Segments created for a lease: fresh memory in a save's or restore's path."""
        self.spares = SpareSegments(self)
        """Free segments made in the background when one leaves service (spares.py)."""
        self._fresh: set[str] = set()  # segments made for the lease being granted
        self.stopping = False
        """Stop began (:meth:`begin_stop`): no segment is made from now on."""

    @property
    def allocated_bytes(self) -> int:
        """Shared memory held: segments (free, leased, kept), those being made for a
        lease or as a spare, and removed ones the daemon still maps. What the budget
        bounds."""
        return super().allocated_bytes + self.spares.making_bytes

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

    def begin_stop(self) -> None:
        """Stop begins: no segment is made from now on, for a spare or a lease (those
        still finishing use what the pool holds)."""
        self.stopping = True
        self.spares.close(wait=False)

    def close(self) -> None:
        """Unlink every segment and every other name in the directory, mapped or not,
        and the directory; unmap what no view uses any more. A spare being made is
        waited for (it is removed, never pooled)."""
        self.begin_stop()
        self.spares.close(wait=True)
        self._remove_all()
        self._leases.clear()

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
        image: tuple[str, int] | None = None,
        reserve: bool = False,
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
        ``owner``: the ``(uid, pid)`` the lease is granted to. ``image``: the ``(job,
        rank)`` of a save that would rather have the segment holding its last committed
        image (:attr:`Segment.image`; :attr:`Lease.holds` says if it got it).
        ``reserve``: a client's reservation ahead of its saves (client/ahead.py): from
        a free segment, a spare being made or the budget's free room only.
        """
        check_holder(holder)
        deadline = time.monotonic() + max(0.0, wait_seconds)
        uid = owner[0] if owner else self.uid_of(job)
        if owner is not None:
            self._savers.add(owner)
        waiting = False
        try:
            while True:
                try:
                    return await self._acquire_now(
                        job, size_bytes, restore, holder, owner, populate, image, reserve
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
        image: tuple[str, int] | None = None,
        reserve: bool = False,
    ) -> Lease:
        self.reclaim_expired()
        need = self.check_fits(size_bytes)
        uid = owner[0] if owner else self.uid_of(job)
        held = held_by_uid(self._leases.values())
        others = {*self._waiting, *(saver[0] for saver in self._savers)}
        why = over_share(uid, need, held, others, self.budget_bytes, self.share_per_uid)
        if why:
            raise StagingBusy(
                f"staging memory for {size_bytes} bytes must wait: {why}; "
                f"{self.holders(uid)}. Wait for earlier saves to reach LOCAL, or ask the "
                "operator to raise staging_budget_bytes"
            )
        seg = self._reusable(need, uid, holder, image)
        if seg is None:
            seg = await self._room_for(need, uid, size_bytes, populate, reserve)
        fresh = seg.name in self._fresh
        self._fresh.discard(seg.name)
        lease = self._grant(job, seg, restore, holder, owner=owner, image=image)
        if not restore and fresh and self._room.grows_with(job, seg.size):
            # Made for this save, which the memory tier will keep: the pool had no
            # segment of its size, and the next save would make one in its own time.
            self.spares.want(seg.size, uid, early=True)
        return lease

    def _reusable(
        self, need: int, uid: int | None, holder: str, image: tuple[str, int] | None
    ) -> Segment | None:
        """A free segment to grant as it is: the one holding this client's own last
        image first (its unchanged shards need no copy), then the smallest that fits,
        one that holds another client's image last among equals (that client's next
        save may want it). None: the pool grows, or room is made."""
        own = partial(Segment.holds_image, image=image, holder=holder)
        free = sorted(self.free_segments(), key=lambda s: (not own(s), s.size, bool(s.image)))
        seg = next((s for s in free if s.size >= need and s.uid in (None, uid)), None)
        if (
            seg is not None
            and image is not None
            and seg.image is not None
            and seg.image[:2] != image
            and self.allocated_bytes + need <= self.budget_bytes
        ):
            # Another job's or rank's image stays for its next save: the pool grows
            # (an earlier process of this job and rank left its image to nobody).
            return None
        return seg

    async def _room_for(
        self, need: int, uid: int | None, size_bytes: int, populate: bool, reserve: bool
    ) -> Segment:
        """A segment of ``need`` bytes when no free one is granted as it is, within the
        budget: a spare of that size being made is waited for (begun earlier, it is
        ready sooner than a new one, and two would stay one too many), the memory
        tier's kept segments go next (room.py), then a spare of another size being
        made is waited for (it holds room, counted), free segments of other uids and
        too small ones are dropped, and a new one is made. StagingBusy if the budget
        still has no room; for a reservation, past the spare, as soon as it has none."""

        def fits() -> Segment | None:
            free = sorted(self.free_segments(), key=lambda s: s.size)
            return next((s for s in free if s.size >= need and s.uid in (None, uid)), None)

        if (made := self.spares.claim(need)) is not None:
            await asyncio.wait([made])  # made for this one alone: it joins the pool first
            if (seg := fits()) is not None:
                return seg
        if reserve and self.allocated_bytes + need > self.budget_bytes:
            raise StagingBusy(f"no room to reserve {size_bytes} bytes of staging memory")
        if self.allocated_bytes + need > self.budget_bytes:
            await self._room.give_way(need, uid)  # the memory tier's segments go first
            if (seg := fits()) is not None:
                return seg
        if self.allocated_bytes + need > self.budget_bytes and self.spares.making_bytes:
            # A spare being made holds the room it was made for, counted: it joins the
            # pool in a moment, faulted in (or goes); wait rather than exceed the budget.
            await self.spares.settle()
            if (seg := fits()) is not None:
                return seg
        free = sorted(self.free_segments(), key=lambda s: s.size)
        # Drop free segments another uid used, then those too small, until the new one
        # fits the budget.
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
        return await self._create_or_shed(need, populate, uid)

    async def _create_or_shed(self, need: int, populate: bool, uid: int | None) -> Segment:
        """A new segment of ``need`` bytes; if the shm filesystem is full (a tmpfs
        smaller than the budget), the memory tier's segments go first and one that
        fits is reused, or the free ones are removed to make room, and one more try."""
        try:
            return await self._new_segment(need, populate)
        except ResourceExhausted:
            if not await self._room.shed(need):
                raise
        free = self.free_segments()
        fit = next((s for s in free if s.size >= need and s.uid in (None, uid)), None)
        if fit is not None:
            return fit
        for s in free:
            self._destroy(s)
        return await self._new_segment(need, populate)

    async def _new_segment(self, need: int, populate: bool) -> Segment:
        if self.stopping:
            raise Stopping(
                "the daemon is stopping and makes no shared memory; the save or restore "
                "is retried against the next daemon"
            )
        self._reserved += need  # counted while it is made, off the loop
        try:
            seg = await asyncio.to_thread(self._create, need, populate)
        finally:
            self._reserved -= need
        move(seg, SegState.FREE, "made for a lease")
        self._segments[seg.name] = seg
        self._fresh.add(seg.name)
        self.segments_created += 1
        return seg

    def process_gone(self, process: tuple[int, int]) -> None:
        """Client process ``(uid, pid)`` exited (api/sessions.py): its uid no longer
        has a part kept for it on its account, so the others' parts grow."""
        if process in self._savers:
            self._savers.discard(process)
            self._wake()

    # -- spares (spares.py) --------------------------------------------------
    def _left_service(self, seg: Segment) -> None:
        self.spares.want(seg.size, seg.uid)

    def create_segment(self, size: int) -> Segment:
        """A new segment of ``size`` bytes, faulted in, not yet in the pool (blocking:
        any thread; :meth:`add_free` or :meth:`remove_segment` takes it)."""
        return self._create(size)

    def add_free(self, seg: Segment) -> None:
        """A segment from :meth:`create_segment` joins the pool, free."""
        move(seg, SegState.FREE, "a spare joins the pool")
        self._segments[seg.name] = seg
        self._wake()  # a save waiting for memory may take it

    def remove_segment(self, seg: Segment) -> None:
        """Unlink and unmap a segment :meth:`create_segment` made that is not in the
        pool (any thread: it touches nothing the pool holds)."""
        move(seg, SegState.GONE, "a spare not needed any more")
        (self.dir / seg.name).unlink(missing_ok=True)
        seg.mapping.close()

    def holders(self, uid: int | None) -> str:
        """What holds the leased memory right now, in words, as ``uid`` may see it
        (share.py: other users' jobs are never named)."""
        return holders_text(self._leases.values(), uid, self._clock())

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
            key=lambda s: (s.size, bool(s.image)),  # a save's image kept where it can be
        )
        if not free:
            return None
        need = round_up(max(size_bytes, 1), SEGMENT_GRANULE)
        if len(free) < 2 and self.allocated_bytes + need > self.budget_bytes:
            return None
        return self._grant(job, free[0], restore=True)
