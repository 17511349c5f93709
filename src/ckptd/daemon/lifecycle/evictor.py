"""The evictor: applies each job's retention plan (planner.py) to the tiers.

It runs after every transition that can change a plan (a commit, an upload, a
pin, a fetch), and every 30 s (time-based policies, free space). Local copies
are renamed into ``<root>/.trash`` (their commit point in reverse: gone from
view at once) and then deleted; a remote copy loses its ``_complete`` marker
before its objects, so a half-deleted step is never listed. Below the low
watermark it also removes local copies the bucket holds, oldest first, until the
mark is met. Admission asks it for :meth:`relieve_local` (local only) before
refusing a save.

A step that a kept step references (core/increments.py) stays in that tier
(retention/references.py). Plans are made again right before each deletion,
from the catalog as it is then (a save may have referenced a step, or the drain
taken one, since the pass began): what a kept step, a step in use or a step on
its way to the bucket reads is never deleted, and a crash at any point leaves
either the whole step or its removal to finish at the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from ckptd.proto import ckptd_pb2 as pb

from .. import faults
from ..catalog import Catalog, Event, Step
from ..io import IoPool
from ..local.admission import DiskSpace, gib
from ..local.store import LocalStore, prune_held
from ..remote import held
from ..remote.base import Remote
from ..remote.index import NodeIndex
from ..remote.layout import pin_key
from ..remote.retract import delete_copy, retract_marker
from ..retention.planner import Retention

log = logging.getLogger("ckptd.evictor")

PERIOD_SECONDS = 30.0
_KICKED_BY = frozenset(
    {
        pb.STEP_EVENT_LOCAL,
        pb.STEP_EVENT_DURABLE,
        pb.STEP_EVENT_FETCHED,
        pb.STEP_EVENT_PINNED,
        pb.STEP_EVENT_UNPINNED,
        pb.STEP_EVENT_DISCOVERED,
        pb.STEP_EVENT_RECOVERED,
        pb.STEP_EVENT_SUPERSEDED,
    }
)
"""Transitions after which a plan may have changed."""


class Evictor:
    """One per daemon; ``remote`` is None without a remote tier."""

    def __init__(
        self,
        catalog: Catalog,
        retention: Retention,
        store: LocalStore,
        disk: DiskSpace,
        io: IoPool,
        remote: Remote | None,
        index: NodeIndex | None,
        may_write_remote: Callable[[], bool] = lambda: True,
    ) -> None:
        self.catalog = catalog
        self.retention = retention
        self.store = store
        self.disk = disk
        self.io = io
        self.remote = remote
        self.index = index
        self.may_write_remote = may_write_remote
        """Whether this daemon holds its node name's claim in the bucket (claim.py):
        without it, another daemon's copies would be deleted under the shared name."""
        self.evicted_local = 0
        self.evicted_remote = 0
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._local_due = False
        """A transition since the last local pass: bucket deletions pause for one."""
        self._local = asyncio.Lock()
        """Held for local-tier work only, so admission never waits behind bucket I/O."""
        catalog.subscribe(self._on_event)

    def _on_event(self, event: Event) -> None:
        if event.kind in _KICKED_BY:
            self._local_due = True
            self.kick()

    def kick(self) -> None:
        """Ask for a pass soon."""
        self._wake.set()

    def stop(self) -> None:
        """Stop after the current pass."""
        self._stop.set()
        self._wake.set()

    async def run(self) -> None:
        """Pass after every kick, and every PERIOD_SECONDS (supervised: errors restart it)."""
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), PERIOD_SECONDS)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                await self.run_once()
            except Exception:  # one bad step must not stop retention: the next pass retries
                log.exception("eviction pass failed")

    async def run_once(self) -> None:
        """One pass: the local tier first (the disk saves need), then the bucket."""
        self._local_due = False
        await self.relieve_local()
        jobs = self.retention.jobs
        await jobs.sync()  # the bucket's records a transient error left behind
        for job in self.catalog.jobs():
            if self.remote is not None and not await jobs.settled(job):
                continue  # its own policy, if any, is unknown: its bucket copies wait
            # Newest first: the steps a step reads are older, so whatever is left in the
            # bucket at any moment (a pass cut short too) holds what it reads.
            for step in sorted(self.retention.plan(job).evict_remote, reverse=True):
                if self._local_due:
                    # Bucket deletions are slow and many under a high save rate; the
                    # disk must not wait for them to finish: a local pass first.
                    self._local_due = False
                    await self.relieve_local()
                await self._evict_remote(job, step, "retention")
            await self._prune_held_remote(job)

    async def _prune_held_remote(self, job: str) -> None:
        """Replaced steps' copies held in the bucket go once no step of this node there
        (or on its way there) reads them (remote/held.py)."""
        if self.remote is None or self.index is None or not self.index.held_now(job):
            return
        if not self.may_write_remote():
            return
        try:
            await held.prune(
                self.remote, self.index, job, self.catalog.node_id, self.catalog.read_copies(job)
            )
        except Exception as exc:  # the next pass tries again
            log.warning("could not delete held copies of %s from %s: %s", job, self.remote.url, exc)

    async def relieve_local(self) -> None:
        """A pass over the local tier only: every job's plan, then the low watermark.
        Admission runs it inside an RPC: it does no bucket I/O."""
        async with self._local:
            await self._evict_local_batch(
                [
                    (job, step)
                    for job in self.catalog.jobs()
                    for step in self.retention.plan(job).evict_local
                ],
                "retention",
            )
            await self._relieve_pressure()
            # Replaced steps' copies kept for steps that read them go with the last one.
            await prune_held(self.catalog, self.store, self.io)

    def _still_evictable(self, keys: list[tuple[str, int]], pressure: bool) -> list[Step]:
        """Of ``keys``, the local copies the plan made now still lets go (a save may
        have referenced one, a restore or the drain taken one, since it was chosen)."""
        plans = {job: self.retention.plan(job) for job in {job for job, _ in keys}}
        # Newest first: a step leaves view before the older steps it references, so a
        # kill between two renames never leaves a step whose holder is gone.
        return [
            st
            for job, step in sorted(keys, key=lambda k: (k[0], -k[1]))
            if (st := self.catalog.get(job, step)) is not None
            and st.local
            and not self.retention.busy(st)
            and step in (plans[job].pressure if pressure else plans[job].evict_local)
        ]

    async def _evict_local_batch(
        self, keys: list[tuple[str, int]], why: str, pressure: bool = False
    ) -> None:
        """Evict many local copies in one go: one fsync per job directory, not one per
        step (under a heavy write load each fsync waits behind the writes)."""
        steps = self._still_evictable(keys, pressure)
        if not steps:
            return
        with contextlib.ExitStack() as held:
            for st in steps:
                # The drain leaves them alone; a restore that chose one just before
                # and finds its files gone waits for this instead of setting it aside;
                # a save does not reference it (the in-use flag says it is going).
                held.enter_context(self.catalog.in_use(st, evicting=True))
            if faults.armed("evict.referenced") and self._with_references(steps):
                await asyncio.to_thread(faults.hit, "evict.referenced")
            await self.io.run(self.store.evict_many, [st.key for st in steps])
        for st in steps:
            self.evicted_local += 1
            log.info("evicted %s/%d from the local tier (%s)", st.job, st.step, why)
            self.catalog.local_removed(st, pb.STEP_EVENT_EVICTED_LOCAL, why)

    def _with_references(self, steps: list[Step]) -> bool:
        """Whether a job of ``steps`` has local steps that reference others (the
        failpoint ``evict.referenced``: an eviction a crash must not turn into a kept
        step without its holders)."""
        return any(
            s.local and s.references()
            for job in {st.job for st in steps}
            for s in self.catalog.list(job)
        )

    async def _relieve_pressure(self) -> None:
        space = self.disk.space()
        low, _ = self.disk.marks(space)
        if space.free >= low:
            return
        if await self.io.run(self.store.drop_spares) and self.disk.space().free >= low:
            return  # spare files were enough
        tried: set[tuple[str, int]] = set()
        while self.disk.space().free < low:
            # Planned again after each eviction: a holder becomes a candidate once
            # the step that referenced it is gone.
            candidates = [
                (st.time, job, step)
                for job in self.catalog.jobs()
                for step in self.retention.plan(job).pressure
                if (job, step) not in tried and (st := self.catalog.get(job, step)) is not None
            ]
            if not candidates:
                break
            _, job, step = min(candidates)
            tried.add((job, step))
            why = f"free space below the low watermark {gib(low)}"
            await self._evict_local_batch([(job, step)], why, pressure=True)
            # Its files were kept as spares, which frees nothing: below the mark the
            # space is wanted now, or every candidate would go for the same bytes.
            await self.io.run(self.store.drop_spares)

    async def _evict_remote(self, job: str, step: int, why: str) -> None:
        st = self.catalog.get(job, step)
        if st is None or self.remote is None or self.index is None:
            return
        if not self.may_write_remote():
            return  # retried at the next pass, once the claim is held
        try:
            # A pin set through another node's daemon is only in the bucket: look.
            if await self.remote.exists(pin_key(job, step, st.adopted)):
                self.catalog.set_pinned(st, True)
                log.info("%s/%d is pinned in the bucket: kept", job, step)
                return
        except Exception as exc:
            log.warning("could not remove %s/%d from %s: %s", job, step, self.remote.url, exc)
            return
        # Planned again now: a step that references it may have gone up (or started
        # to) meanwhile. From here the drain counts it out of the bucket (holders.py),
        # and a fetch of it is refused (remote/source.py).
        if step not in self.retention.plan(job).evict_remote:
            return
        self.retention.retracting.add(st.key)
        try:
            with self.index.removing(job, step):
                await self._retract(st, why)
        finally:
            self.retention.retracting.discard(st.key)

    async def _retract(self, st: Step, why: str) -> None:
        assert self.remote is not None and self.index is not None
        (job, step), node_id = st.key, self.catalog.node_id
        marker_gone = True
        try:
            # Its entry flagged, then the marker (remote/retract.py): from then on the
            # step is not complete, never listed or restored by any node.
            await retract_marker(self.remote, self.index, job, step, node_id, st.adopted)
        except Exception as exc:
            log.warning("could not remove %s/%d from %s: %s", job, step, self.remote.url, exc)
            if not self.index.flagged(job, step):
                return  # nothing changed in the bucket: planned again at the next pass
            marker_gone = False  # flagged: the drain finishes it (lifecycle/replaced.py)
        self.catalog.remote_removed(st, "removed from the remote tier by its retention policy")
        if not marker_gone:
            return
        try:
            # Held meanwhile: the drain uploads no copy of it (as a holder) while its
            # objects go, under keys that name its number.
            with self.catalog.in_use(st):
                await delete_copy(self.remote, self.index, job, step, node_id, st.adopted)
        except Exception as exc:  # the entry is flagged: the drain finishes it
            log.warning(
                "could not remove %s/%d's objects from %s: %s", job, step, self.remote.url, exc
            )
            return
        self.evicted_remote += 1
        log.info("evicted %s/%d from the remote tier (%s)", job, step, why)
