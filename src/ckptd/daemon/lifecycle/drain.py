"""The drain: uploads LOCAL steps to the remote tier in the background.

Newest first and coalescing: when the uploader is free it takes each job's
newest LOCAL step; an older pending step goes up only if the remote retention
would keep it (the retention plan's ``remote_wants``), otherwise it becomes
SUPERSEDED once a newer step is DURABLE. Each step's objects are uploaded in
parallel parts and verified against the crc32c recorded at local commit, then
committed with the ``_complete/<node>`` marker last and recorded in the node's
step index (publish.py, index.py). Transient errors (as the backend
classifies them) are retried with exponential backoff and full jitter; a
permanent one marks the step FAILED, but its local copy stays restorable and
its upload is tried again later (backoff from ``retry_max_seconds`` doubling to
ten minutes), so it goes up once the store is fixed. A local copy whose bytes no
longer match their checksums is set aside and the step FAILED for good. An
upload that makes no progress for ``stall_seconds`` (a store that hangs without
an error) shows as the drain's error in status while it keeps waiting. At
start-up, the node's index of each job it holds locally (one GET per job, never
a listing of the bucket) says which steps are DURABLE; the others are queued
again, and their files already in the bucket with the right crc32c are not sent
twice. A job that appears later is matched so before its first upload (queue.py).
A job may ask for an upload pace (pace.py); a step that references older steps'
rank files goes up after them (holders.py); between uploads, replaced saves'
copies no upload will take out go (replaced.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from ckptd.proto import ckptd_pb2 as pb

from .. import faults
from ..catalog import Catalog, Event, Step
from ..io import IoPool
from ..local.store import LocalStore
from ..remote.base import Remote
from ..remote.claim import NodeClaim
from ..remote.index import NodeIndex
from ..remote.publish import HolderMissing, Publisher
from ..retention.planner import Retention
from ..retry import Backoff
from . import queue
from .holders import Holders
from .pace import UploadPace
from .replaced import ReplacedCopies

log = logging.getLogger("ckptd.drain")

PERIOD_SECONDS = 30.0
REVIVE_MAX_SECONDS = 600.0
"""Longest pause before a FAILED upload (local copy intact) is tried again."""

_WOKEN_BY = frozenset(
    {
        pb.STEP_EVENT_LOCAL,
        pb.STEP_EVENT_PINNED,
        pb.STEP_EVENT_UNPINNED,
        pb.STEP_EVENT_EVICTED_REMOTE,
        pb.STEP_EVENT_REQUEUED,
        pb.STEP_EVENT_REPLACED,
        pb.STEP_EVENT_SUPERSEDED,
        pb.STEP_EVENT_EVICTED_LOCAL,
    }
)
"""Transitions that can put a step in the queue or change what the bucket wants."""


def _cancelling() -> bool:
    """Whether the running task itself is being cancelled (the daemon stops)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Drain:
    """One background uploader per daemon."""

    def __init__(
        self,
        catalog: Catalog,
        remote: Remote,
        index: NodeIndex,
        store: LocalStore,
        io: IoPool,
        retention: Retention,
        retry_max_seconds: float,
        stall_seconds: float = 45.0,
        claim: NodeClaim | None = None,
    ) -> None:
        self.catalog = catalog
        self.remote = remote
        self.index = index
        self.store = store
        self.io = io
        self.retention = retention
        self.node_id = catalog.node_id
        self.backoff = Backoff(0.5, retry_max_seconds, jitter=True)
        self._revive = Backoff(retry_max_seconds, REVIVE_MAX_SECONDS)
        """When an upload that failed for good is tried again (its local copy intact)."""
        self.retry_max_seconds = retry_max_seconds
        self.stall_seconds = stall_seconds
        self.claim = claim
        """The node name's claim in the bucket: nothing is uploaded while it is not held."""
        self.last_error = ""
        self._failed_uploads: dict[tuple[str, int], tuple[int, float]] = {}
        """FAILED uploads with an intact local copy: (failures so far, next try at)."""
        self.holders = Holders(catalog, retention.retracting, index.held_now)
        self.publisher = Publisher(
            remote,
            index,
            store,
            io,
            self.node_id,
            stall_seconds,
            self._stalled,
            reading=catalog.read_copies,
            holders_missing=self.holders.missing_reason,
        )
        self.replaced = ReplacedCopies(catalog, remote, index, stall_seconds)
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._uploading: tuple[Step, asyncio.Future[tuple[int, int] | None]] | None = None
        """The step being published and its task (cancelled if the step is replaced)."""
        self.resumed = False
        """The node's index matched against the local steps (:meth:`resume`)."""
        self.pace = UploadPace()
        """Each job's upload pace, as its newest commit asked (pace.py)."""
        catalog.subscribe(self._on_event)
        # A LOCAL step read meanwhile (its peer replication, a restore) was passed over.
        catalog.on_free(lambda st: self._wake.set() if st.state == pb.SAVE_STATE_LOCAL else None)

    def _on_event(self, event: Event) -> None:
        if event.kind in _WOKEN_BY:
            self._wake.set()
        uploading = self._uploading
        if (
            event.kind == pb.STEP_EVENT_REPLACED
            and uploading is not None
            and (event.job, event.step) == uploading[0].key
        ):
            uploading[1].cancel()  # a new save took its number: its copy is not wanted

    def _replaced(self, st: Step) -> bool:
        """A new save took ``st``'s number while it was being uploaded: the new save's
        upload takes this copy out of the bucket (publish.py); ``st`` goes no further."""
        if self.catalog.get(*st.key) is st:
            return False
        if st.state == pb.SAVE_STATE_DRAINING:
            self.catalog.requeued(st, "replaced by a new save under its number: not uploaded")
        return True

    @property
    def queue_length(self) -> int:
        """Steps waiting to be uploaded (or being uploaded)."""
        return self.catalog.count(pb.SAVE_STATE_LOCAL) + self.catalog.count(pb.SAVE_STATE_DRAINING)

    async def resume(self) -> None:
        """Match the local steps against this node's index in the bucket (start-up): one
        GET per job held locally; jobs only in the bucket are read when first asked for
        (remote/source.py). Steps still to upload may have been cut mid-upload by the last
        daemon: their files are looked for before they are sent again."""
        limit = asyncio.Semaphore(16)

        async def one(job: str) -> int:
            async with limit:
                return await queue.match(self.catalog, self.index, job)

        found = await asyncio.gather(*(one(job) for job in sorted(self.catalog.jobs())))
        for st in self.catalog.steps():
            if st.state == pb.SAVE_STATE_LOCAL:
                self.publisher.suspect.add(st.key)
        self.resumed = True
        log.info(
            "remote %s: %d complete steps of this node in %d jobs; %d local steps to upload",
            self.remote.url,
            sum(found),
            len(found),
            self.queue_length,
        )

    def supersede_unwanted(self) -> None:
        """Pending steps the bucket will never want become SUPERSEDED (queue.py)."""
        queue.supersede_unwanted(self.catalog, self.retention, self.node_id)

    def pick(self) -> Step | None:
        """The step to upload next (queue.py)."""
        return queue.pick(self.catalog, self.retention, self.pace, self.node_id)

    async def _still_goes(self, st: Step) -> bool:
        """Whether ``st`` still goes up. A job the start-up did not match (taken back
        from a peer after a node loss, or first saved since) is matched first
        (queue.py): the bucket may hold a later save under ``st``'s number, which the
        upload would otherwise retract as the one ``st`` replaced; ``st`` gives way."""
        if not self.index.known(st.job):
            await queue.match(self.catalog, self.index, st.job)
        return self.catalog.get(*st.key) is st

    def stop(self) -> None:
        """Ask the loop to stop after the current attempt (the step is retried next start)."""
        self._stop.set()
        self._wake.set()

    def lag(self) -> float:
        """Seconds the oldest step waiting for the bucket has waited since its handoff."""
        pending = (pb.SAVE_STATE_LOCAL, pb.SAVE_STATE_DRAINING)
        steps = [s for s in self.catalog.steps() if s.state in pending]
        waiting = [s.handoff_at or s.created_unix for s in steps]
        return max(0.0, time.time() - min(waiting)) if waiting else 0.0

    async def run(self) -> None:
        """Upload until stopped (supervised: an unexpected error restarts the loop)."""
        if not self.resumed:
            await self.resume()
        while not self._stop.is_set():
            if faults.armed("drain.loop"):
                await asyncio.to_thread(faults.hit, "drain.loop")
            if self.claim is not None and not self.claim.held:
                await self._wait_for_claim(self.claim)
                continue
            self.supersede_unwanted()
            await self.replaced.run()  # between uploads: none runs under their numbers
            next_revival = self._revive_failed()
            picked = self.pick()
            st = self._holder_first(picked) if picked is not None else None
            if st is None:
                self._wake.clear()
                if picked is not None or self.pick() is None:
                    # Woken by new work, or a paced job's turn; every PERIOD_SECONDS
                    # anyway, because time-based remote policies change what the
                    # bucket wants as time passes.
                    paced = self.pace.next_due(self._waiting_jobs())
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            self._wake.wait(), min(PERIOD_SECONDS, next_revival, paced)
                        )
                continue
            if st is picked:
                self._paced_out(st)
            try:
                await self._drain(st)
            except BaseException:
                if st.state == pb.SAVE_STATE_DRAINING:  # not stuck DRAINING after a restart
                    self.catalog.requeued(st, "the drain stopped on an error; it goes again")
                raise

    async def _wait_for_claim(self, claim: NodeClaim) -> None:
        """Upload nothing until the claim is held (another daemon writes under this
        node's name): status shows why; the steps wait LOCAL."""
        self.last_error = claim.reason
        claim.changed.clear()
        if claim.held:
            return
        stop = asyncio.ensure_future(self._stop.wait())
        held = asyncio.ensure_future(claim.changed.wait())
        try:
            await asyncio.wait({stop, held}, timeout=PERIOD_SECONDS, return_when="FIRST_COMPLETED")
        finally:
            stop.cancel()
            held.cancel()
        if claim.held:
            self.last_error = ""

    def _stalled(self, st: Step, reason: str) -> None:
        self.last_error = reason
        log.warning("%s", reason)
        self.catalog.retrying(st, reason)

    def _revive_failed(self) -> float:
        """Put FAILED uploads whose time has come back in the queue; returns the seconds
        until the next one is due."""
        now = time.monotonic()
        due = PERIOD_SECONDS
        for key, (failures, at) in list(self._failed_uploads.items()):
            st = self.catalog.get(*key)
            if st is None or st.state != pb.SAVE_STATE_FAILED or not st.local:
                del self._failed_uploads[key]
            elif at <= now:
                self.catalog.requeued(st, f"upload failed {failures} times; trying again")
            else:
                due = min(due, at - now)
        return due

    def _holder_first(self, st: Step) -> Step | None:
        """The step to upload for ``st``: itself, or the oldest step it references that
        is not in the bucket yet (queued again if it was not waiting). None: nothing can
        go now (a holder is leaving the bucket, or ``st`` failed: holders.py)."""
        need = self.holders.first_missing(st)
        if need is None:
            return st
        if isinstance(need, str):
            log.error("%s/%d: %s", st.job, st.step, need)
            self.last_error = need
            self.catalog.draining(st)
            self.catalog.failed(st, need, "remote")
            return None
        if need.state == pb.SAVE_STATE_FAILED and need.key in self._failed_uploads:
            return None  # its own upload failed: tried again when its backoff ends
        if need.state in (pb.SAVE_STATE_SUPERSEDED, pb.SAVE_STATE_FAILED):
            self.catalog.requeued(need, f"step {st.step} references it: it goes up first")
        # DURABLE: the evictor is taking it out of the bucket; it goes up again after.
        return need if need.state == pb.SAVE_STATE_LOCAL and not need.busy else None

    def _waiting_jobs(self) -> set[str]:
        return {s.job for s in self.catalog.steps() if s.state == pb.SAVE_STATE_LOCAL}

    def _paced_out(self, st: Step) -> None:
        """``st`` of a paced job goes up: the older steps the pace skipped never will."""
        interval = self.pace.interval(st.job)
        if not interval or st.milestone:
            return
        self.pace.started(st.job)
        keep = self.holders.pace_keeps(st)  # what st and waiting milestones reference
        for s in self.catalog.list(st.job):
            if s.order < st.order and s.state == pb.SAVE_STATE_LOCAL and not s.milestone:
                if s.step in keep:
                    continue
                self.catalog.superseded(
                    s,
                    f"not uploaded: the job uploads at most every {interval:.3g} s (its "
                    f"policy's upload interval); step {st.step} went instead",
                )

    def _newer_pending(self, st: Step) -> bool:
        return any(
            s.order > st.order and s.state == pb.SAVE_STATE_LOCAL for s in self.catalog.list(st.job)
        )

    async def _drain(self, st: Step) -> None:
        self.catalog.draining(st)
        attempt = 0
        while True:
            if self._replaced(st):
                return
            if st.manifest is None:  # set aside as corrupt by a restore meanwhile
                self.catalog.failed(
                    st, "its local copy failed a checksum and was set aside", "remote"
                )
                return
            task = asyncio.ensure_future(self.publisher.publish(st, lambda: self._still_goes(st)))
            self._uploading = (st, task)
            try:
                done = await task
                if done is None:  # it gave way to the bucket's later save
                    self._replaced(st)
                    return
                sent, skipped = done
                break
            except asyncio.CancelledError:
                if task.cancelled() and not _cancelling() and self._replaced(st):
                    return
                raise
            except Exception as exc:
                delay = await self._failed(st, exc, attempt)
                if delay is None:
                    return
                attempt += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
            finally:
                self._uploading = None
        self.last_error = ""
        self._failed_uploads.pop(st.key, None)
        if self._replaced(st):
            return
        self.catalog.durable(st, files_sent=str(sent), files_skipped=str(skipped))
        log.info(
            "%s/%d DURABLE in %.3f s after handoff", st.job, st.step, st.durable_at - st.handoff_at
        )

    async def _failed(self, st: Step, exc: Exception, attempt: int) -> float | None:
        """An upload attempt of ``st`` failed: the seconds to wait before the next, or
        None when this drain of it ends (its holders go first, it was replaced, the
        daemon stops, its local bytes changed, the error is not transient, or a newer
        step goes first)."""
        self.publisher.suspect.add(st.key)  # parts of it may be in the bucket
        if isinstance(exc, HolderMissing):  # they go first, then it goes again
            self.catalog.requeued(st, str(exc))
            return None
        if self._replaced(st):
            return None
        if self._stop.is_set():
            self.catalog.requeued(st, "the daemon is stopping")
            return None
        reason = f"upload to {self.remote.url} failed: {exc}"
        # A checksum mismatch may mean the local bytes changed: check once.
        suspect = attempt == 2 or "crc32c" in str(exc)
        changed = await self.publisher.local_changed(st) if suspect else ""
        if changed:
            log.error("%s/%d: %s", st.job, st.step, changed)
            self.last_error = changed
            await self.io.run(self.store.set_aside, st.job, st.step)
            self.catalog.local_removed(st, pb.STEP_EVENT_SET_ASIDE, changed)
            self.catalog.failed(st, changed, "remote")
            return None
        if not self.remote.is_transient(exc):
            failures = self._failed_uploads.get(st.key, (0, 0.0))[0] + 1
            wait = self._revive.delay(failures - 1)
            self._failed_uploads[st.key] = (failures, time.monotonic() + wait)
            reason += f"; the local copy stays restorable, next try in {wait:.0f} s"
            log.error("%s/%d: %s", st.job, st.step, reason)
            self.last_error = reason
            self.catalog.failed(st, reason, "remote")
            return None
        delay = self.backoff.delay(attempt)
        self.last_error = f"retrying in {delay:.1f} s: {reason}"
        log.warning("%s/%d: %s", st.job, st.step, self.last_error)
        self.catalog.retrying(st, self.last_error)
        self.supersede_unwanted()  # other steps may be unwanted by now
        if self._newer_pending(st) and st.step not in self.retention.plan(st.job).remote_wants:
            self.catalog.requeued(st, "a newer step goes first (coalescing)")
            return None
        return delay
