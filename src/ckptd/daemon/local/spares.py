"""Spare segments: a free segment made ready in the background when one leaves the
staging pool's service, so the next save reuses memory already faulted in.

A segment leaves the pool's service while the memory tier keeps it (memory.py), and
for good once a trainer restored from it maps it copy-on-write (lending.py). A
trainer restarted
from the memory tier owns the segment it restored from; its first save takes the
pool's last free segment of that size, the tier keeps that one, and the second save
would otherwise create a segment in its own blocking time. Fresh memory is the
slowest part of a save on these machines (docs/architecture.md, "Performance
notes"), so the pool makes that segment beforehand, off the save's path.

Rules:

- **Off every critical path.** One worker thread of its own creates and faults in
  the segment (as any segment: populated whole); the event loop only decides and
  takes the result, and no save or restore ever waits for it.
- **Bounded.** A spare is made only when no free segment of that size is left, none
  of that size is being made, and the budget has room for the spare and one more
  save of that size besides every lease and kept segment: a save that comes while
  the spare is made still fits.
- **Inside the budget.** A spare being made counts in the budget like any segment
  (staging.Staging.allocated_bytes). A save that finds no room while one is being
  made waits for it (it joins the pool faulted in, a moment later) rather than
  exceed the budget; if a save made its own segment meanwhile, or a free segment of
  that size came back, the finished spare is removed instead of joining the pool.
- **Nothing once stop begins.** No spare is asked for or started after the pool's
  stop began (staging.Staging.begin_stop); one being made then is removed when done,
  and the pool's close waits for it.
- **An ordinary free segment once made.** The next lease of its size takes it by
  the pool's normal path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from pathlib import Path
from typing import Protocol

from .. import faults
from .lease import Segment

log = logging.getLogger("ckptd.staging")

FAILPOINT = "staging.spare"
"""Hit by the worker before it creates a spare (faults.py): tests hold it there."""


class Pool(Protocol):
    """What spares need of the staging pool (staging.Staging)."""

    budget_bytes: int
    segments_created: int

    @property
    def dir(self) -> Path:
        """The directory segments are made in."""
        ...

    @property
    def allocated_bytes(self) -> int:
        """Shared memory held in segments (free, leased or kept)."""
        ...

    def free_segments(self) -> list[Segment]:
        """Segments no lease holds and the memory tier does not keep."""
        ...

    def create_segment(self, size: int) -> Segment:
        """A new faulted-in segment, not yet in the pool (any thread)."""
        ...

    def saves_in_flight(self, size: int) -> bool:
        """Whether a save lease holds (or is having made) a segment of ``size``."""
        ...

    def making_own(self, size: int) -> bool:
        """Whether a lease is having a segment of at least ``size`` bytes made now."""
        ...

    def add_free(self, seg: Segment) -> None:
        """A created segment joins the pool, free."""
        ...

    def remove_segment(self, seg: Segment) -> None:
        """Unlink and unmap a created segment not in the pool (any thread)."""
        ...


class SpareSegments:
    """Spares for one staging pool. Methods run on the daemon's event loop, except
    where said."""

    def __init__(self, staging: Pool) -> None:
        self.staging = staging
        self.made = 0
        """Spares that joined the pool."""
        self._asked: dict[int, tuple[int | None, bool]] = {}  # size -> (uid, early), next turn
        self._making: dict[int, int] = {}  # size -> segments_created when it began
        self._ready: list[Segment] = []  # made by the worker, not yet taken (under _lock)
        self._lock = threading.Lock()
        self._closed = False
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: set[asyncio.Future[None]] = set()
        self._futures: dict[int, asyncio.Future[None]] = {}  # size -> its spare's making
        self._claimed: set[int] = set()  # sizes whose spare a save waits for

    def want(self, size: int, uid: int | None, early: bool = False) -> None:
        """A segment of ``size`` bytes that ``uid``'s processes used left the pool's
        service: consider a spare once the loop's current callback is done (the
        memory tier lets older copies go right after it keeps a new one, which may
        free a segment of that size). ``early``: a save's segment the memory tier will
        keep as one more was just granted; the spare is begun now, while that save is
        written, so the next one finds it ready."""
        if self._closed or size in self._asked:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a tool outside the daemon): no background
            return
        self._asked[size] = (uid, early)
        if early:  # now: a save that comes before the loop's next turn waits for it
            self._consider(size)
        else:
            loop.call_soon(self._consider, size)

    def claim(self, need: int) -> asyncio.Future[None] | None:
        """The spare of exactly ``need`` bytes being made, for one save to wait for
        (None: none, or another save waits for it): it joins the pool when made,
        whatever was made meanwhile, and that save takes it."""
        made = self._futures.get(need)
        if made is None or need in self._claimed:
            return None
        self._claimed.add(need)
        return made

    def _consider(self, size: int) -> None:
        uid, early = self._asked.pop(size, (None, False))
        st = self.staging
        if self._closed or size in self._making or self._has_free(size, uid):
            return
        if not early and st.saves_in_flight(size):
            # The next save already has its segment (made it, or took a free one): the
            # kept one it supersedes comes back free when it is in. A spare now would be
            # one segment too many for good.
            log.debug("no spare segment of %d bytes: a save in flight holds one", size)
            return
        if st.allocated_bytes + 2 * size > st.budget_bytes or not _shm_room(st, 2 * size):
            log.debug("no spare segment of %d bytes: the staging budget is tight", size)
            return
        self._making[size] = st.segments_created
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, "ckptd-spare")
        made = asyncio.get_running_loop().run_in_executor(self._worker, self._make, size)
        self._pending.add(made)
        self._futures[size] = made
        made.add_done_callback(lambda f: self._made(size, f))

    def _has_free(self, size: int, uid: int | None) -> bool:
        """Whether a save of ``size`` bytes by ``uid`` finds a free segment now."""
        return any(s.size >= size and s.uid in (None, uid) for s in self.staging.free_segments())

    def _make(self, size: int) -> None:
        """(Worker thread) Create and fault in a segment, unless the pool's stop began;
        hand it over unless it began meanwhile (then it goes at once: nothing else
        would remove it)."""
        faults.hit(FAILPOINT)
        if self._closed:
            return
        seg = self.staging.create_segment(size)
        with self._lock:
            if not self._closed:
                self._ready.append(seg)
                return
        self.staging.remove_segment(seg)

    @property
    def making_bytes(self) -> int:
        """Shared memory of spares being made (counted in the budget)."""
        return sum(self._making)

    def _made(self, size: int, done: asyncio.Future[None]) -> None:
        self._pending.discard(done)
        created_before = self._making.pop(size)
        self._futures.pop(size, None)
        claimed = size in self._claimed
        self._claimed.discard(size)
        if not done.cancelled() and done.exception() is not None:
            log.debug("no spare segment of %d bytes: %s", size, done.exception())
        with self._lock:
            ready, self._ready = self._ready, []
        st = self.staging
        for seg in ready:
            if self._closed or (self._has_free(seg.size, None) and not claimed):
                st.remove_segment(seg)
            elif claimed:  # a save waits for it (counted in the budget while made)
                st.add_free(seg)
                self.made += 1
            elif st.segments_created != created_before or st.making_own(seg.size):
                # A save came first and made its own: the pool has its segment back
                # once that save is LOCAL, so a spare now would be one too many.
                log.debug("spare segment %s removed: a save made its own meanwhile", seg.name)
                st.remove_segment(seg)
            elif st.allocated_bytes + seg.size > st.budget_bytes:
                log.debug("spare segment %s removed: saves took the budget meanwhile", seg.name)
                st.remove_segment(seg)
            else:
                st.add_free(seg)
                self.made += 1
                log.debug("spare segment %s (%d bytes) ready for the next save", seg.name, size)

    async def settle(self) -> None:
        """Wait until every spare asked for so far is made or given up (tests, and a
        save short of room while spares hold it: staging.py)."""
        await asyncio.sleep(0)  # the decisions scheduled by want()
        while self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
            await asyncio.sleep(0)  # the done callbacks

    def close(self, wait: bool = True) -> None:
        """The pool stops: no spare is started from now on, one being made is removed by
        the worker once made, those made and not yet taken now. ``wait``: until the
        worker is done (bounded: one segment's allocation)."""
        with self._lock:
            self._closed = True
            ready, self._ready = self._ready, []
        for seg in ready:
            self.staging.remove_segment(seg)
        if self._worker is not None:
            self._worker.shutdown(wait=wait, cancel_futures=True)


def _shm_room(staging: Pool, need: int) -> bool:
    """Whether the shm filesystem has ``need`` bytes free (a tmpfs smaller than the
    budget must not run out because of a spare)."""
    try:
        st = os.statvfs(staging.dir)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= need
