"""The save path: leases granted, handoffs taken, rank files written, steps committed LOCAL.

``CommitShards`` is the acknowledgement point: :meth:`Saver.commit` checks the
request against its lease, records the handoff in the catalog (STAGING), starts
the rank's write in the background and appends the handoff to the journal
(journal.py); the reply goes out once that record is written, so an
acknowledged save survives a daemon crash. The lease stays granted until the
step is LOCAL or FAILED; a step whose other ranks never hand off fails after
``step_timeout_seconds``, and its memory comes back. Each
rank's shards are written from the lease into one safetensors file in the
step's staging directory with ``O_DIRECT``, crc32c computed over each chunk just
written while the next is written; when every rank of the node is written the step commits
(``manifest.json`` last, then the rename: :class:`~ckptd.daemon.commit.RenameCommit`)
and becomes LOCAL. Runs on the event loop; file work goes to the I/O threads.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

from ckptd.core import checksum
from ckptd.core.errors import CkptdError, Conflict, ResourceExhausted
from ckptd.core.format import round_up
from ckptd.core.manifest import rank_file_name
from ckptd.core.names import check_wait
from ckptd.core.timeline import Forks
from ckptd.proto import ckptd_pb2 as pb

from ..catalog import Step
from ..catalog.roles import Saves
from ..io import IoPool
from . import copied, increment, order
from .journal import Entry, Journal
from .memory import MemoryTier
from .pending import CommitRequest, PendingStep, check_join, check_lease, step_manifest
from .rank_write import write_whole
from .records import INLINE_SHARDS, RankLayouts, rank_layout
from .replay import replay as replay_journal
from .roles import Leases
from .staging import Lease
from .store import LocalStore, retire_replaced

log = logging.getLogger("ckptd.node")

MAX_WAIT_SECONDS = 3600.0


Spawn = Callable[[str, Coroutine[Any, Any, None]], None]
"""Starts background work that shutdown waits for (``Supervisor.spawn``)."""


class Saver:
    """Handoffs of one daemon: owns the saves in progress (the catalog owns their states)."""

    def __init__(
        self,
        catalog: Saves,
        staging: Leases,
        store: LocalStore,
        io: IoPool,
        node_id: str,
        spawn: Spawn,
        journal: Journal,
        step_timeout_seconds: float = 600.0,
        memory: MemoryTier | None = None,
        increments: increment.Increments | None = None,
        supersede: bool = True,
    ) -> None:
        self.catalog = catalog
        self.increments = increments or increment.Increments()
        self.habits = increment.Habits()
        self.staging = staging
        self.store = store
        self.io = io
        self.node_id = node_id
        self._spawn = spawn
        self.journal = journal
        self.step_timeout_seconds = step_timeout_seconds
        self.memory = memory
        """Keeps the leases of committed steps instead of freeing them (memory.py)."""
        self.supersede = supersede
        """A newer save takes the place of one whose write has not begun (order.py)."""
        self._pending: dict[tuple[str, int], PendingStep] = {}
        self._settling: set[tuple[str, int]] = set()
        """Steps committed on disk whose leases are still being given back (not LOCAL yet)."""
        self._layouts = RankLayouts()

    # -- leases --------------------------------------------------------------
    async def acquire_lease(
        self,
        job: str,
        size_bytes: int,
        wait_seconds: float = 0.0,
        holder: str = "",
        owner: tuple[int, int] | None = None,
        image: tuple[str, int] | None = None,
        reserve: bool = False,
    ) -> Lease:
        """Grant shared memory for one rank's save, waiting up to ``wait_seconds`` for it;
        ``owner``: the ``(uid, pid)`` of the process that may map it; ``image``: its
        ``(job, rank)``, to be granted the segment that holds its last image if free;
        ``reserve``: a reservation ahead of the saves (staging.py)."""
        wait = check_wait("wait_seconds", wait_seconds, MAX_WAIT_SECONDS)
        return await self.staging.acquire(
            job, size_bytes, wait_seconds=wait, holder=holder, owner=owner, image=image,
            reserve=reserve,
        )  # fmt: skip

    def release_lease(self, lease_id: str) -> None:
        """Give back a lease the client will not commit."""
        if self.staging.get(lease_id).committed:
            raise Conflict(f"lease {lease_id!r} was committed; the daemon returns it when written")
        self.staging.release(lease_id)

    # -- handoffs ----------------------------------------------------------------
    async def commit(
        self,
        req: CommitRequest,
        record: bytes | None,
        replay: tuple[int, Forks] | None = None,
    ) -> int:
        """Take ownership of a lease's shards; returns once the handoff is journaled.

        ``record``: the request as received, for the journal (None: a replay of a
        handoff the journal already holds, with ``replay`` the timeline recorded with
        it). The write runs in the background. A save under the number of a step
        this node holds replaces it (core/timeline.py): see :meth:`Catalog.begin`.
        """
        lease = self.staging.get(req.lease_id)
        data_len = check_lease(req, lease)
        if req.copied_nonce:  # sent while the client copies (copied.py)
            end = req.data_offset + round_up(data_len)
            copied.check(req.copied_at, end, lease, req.copied_holder)
        key = (req.job, req.step)
        st = self.catalog.get(*key)
        pending = self._pending.get(key)
        if st is not None and st.state == pb.SAVE_STATE_STAGING:
            # Another rank of the save in progress under this number: it joins.
            check_join(st, pending, req, key in self._settling)
            assert pending is not None
            self.catalog.joined(st, req.milestone, req.metrics)
        else:
            st, pending = await self._begin(req, st, pending, record, replay)
        self.staging.begin_commit(req.lease_id)
        pending.writing.add(req.rank)
        pending.supersedable &= req.supersede
        pending.leases[req.rank] = lease
        # From here the handoff is carried through whatever becomes of the call: a
        # client that dies with its commit in flight cancels the call, which would
        # leave the step STAGING and its lease held for good.
        handoff = asyncio.ensure_future(self._hand_off(pending, req, lease, data_len, record))
        handoff.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved
        await asyncio.shield(handoff)
        return st.state

    async def _begin(
        self,
        req: CommitRequest,
        st: Step | None,
        pending: PendingStep | None,
        record: bytes | None,
        replay: tuple[int, Forks] | None,
    ) -> tuple[Step, PendingStep]:
        """The first rank of a save under this number: the step begins (STAGING), with
        its staging directory and its place in the I/O queue; a save it replaces is
        noted, and the step fails if its other ranks do not hand off in time."""
        # A replay of this very save (the same timeline) found committed: done.
        same = st is not None and (replay is None or replay[0] == st.timeline)
        if record is None and st is not None and st.in_lineage and same:
            raise Conflict(f"{req.job}/{req.step} was committed before the crash")
        if st is not None and pending is not None and pending.step is st and pending.writing:
            raise Conflict(
                f"step {req.step} of job {req.job!r} failed and its other ranks are still "
                "winding down; save it again in a moment"
            )
        # One place in the I/O queue for all of the step's work (see IoPool); its
        # directory is made by the first write, after the answer (RenameCommit.make).
        ticket = self.io.ticket()
        run = partial(self.io.run, ticket=ticket)
        commit = self.store.begin_step(req.job, req.step, run, make=False)
        # Refused (a pinned step under this number): nothing is left, nothing was made.
        st = self.catalog.begin(
            req.job,
            req.step,
            node_ranks=req.node_ranks,
            world_size=req.world_size,
            milestone=req.milestone,
            metrics=req.metrics,
            timeline=replay,
        )
        pending = self._pending[req.job, req.step] = PendingStep(st, commit, ticket)
        pending.replaces = self.catalog.replacing(st)
        pending.timer = asyncio.get_running_loop().call_later(
            self.step_timeout_seconds, self._check_complete, pending
        )
        return st, pending

    async def _hand_off(
        self,
        pending: PendingStep,
        req: CommitRequest,
        lease: Lease,
        data_len: int,
        record: bytes | None,
    ) -> None:
        """Journal the handoff (``record``; None: a replay) and start the rank's write."""
        st = pending.step
        if record is not None:
            # The journal's record first, alone: nothing else of the save stands
            # between the trainer and its acknowledgement.
            try:
                seg, timeline = lease.segment, (st.timeline, st.forks)
                await self.journal.commit(
                    lease.lease_id, seg.name, req.job, record, timeline, req.step, seg.size
                )
            except Exception as exc:
                pending.writing.discard(req.rank)
                reason = f"the handoff could not be recorded in {self.journal.path}: {exc}"
                await self._fail(pending, reason)
                if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise ResourceExhausted(f"{reason}; free space on the local tier") from None
                raise CkptdError(reason) from None
        self._spawn(
            f"write {req.job}/{req.step} rank {req.rank}",
            self._write_rank(pending, req, lease, data_len),
        )

    async def replay(self, entries: list[Entry], parse: Callable[[bytes], CommitRequest]) -> int:
        """Finish the handoffs a crashed daemon acknowledged (the journal's live records):
        each whose segment survived, and is trusted, is written and committed as if it
        had just arrived (replay.py)."""
        return await replay_journal(self.staging, self.journal, self.commit, entries, parse)

    def _check_complete(self, pending: PendingStep) -> None:
        """``step_timeout_seconds`` after a step began: fail it if ranks are missing."""
        st = pending.step
        missing = set(st.node_ranks) - set(pending.ranks) - pending.writing
        if st.state == pb.SAVE_STATE_STAGING and missing:
            reason = (
                f"ranks {sorted(missing)} of this node never handed off step {st.step} within "
                f"{self.step_timeout_seconds:.0f} s (step_timeout_seconds); the ranks that did "
                "were discarded"
            )
            self._spawn(f"expire {st.job}/{st.step}", self._fail(pending, reason))

    def ranks_written(self, st: Step) -> list[int]:
        """Ranks of a step whose files are written (all of them once it is LOCAL)."""
        pending = self._pending.get(st.key)
        if pending is not None and pending.step is st:
            return sorted(pending.ranks)
        return list(st.node_ranks) if st.local else []

    async def _write_rank(
        self, pending: PendingStep, req: CommitRequest, lease: Lease, data_len: int
    ) -> None:
        st = pending.step
        name = rank_file_name(req.rank)
        # Thousands of shards are per-shard Python: on a thread, not on the loop.
        many = len(req.table) > INLINE_SHARDS
        run = partial(self.io.run, ticket=pending.ticket)
        try:
            if req.copied_nonce:  # sent while the client copies: wait for its word
                await copied.wait(lease, req, self.staging.shm_dir)
            pending.copied.add(req.rank)
            if self.supersede and pending.copied >= set(st.node_ranks):
                self._supersede_older(pending)
            await order.turn(self._pending.values(), pending)  # one step's write at a time
            await run(pending.commit.make)
            layout = self._layouts.get(req)
            if layout is None:
                layout = await run(rank_layout, req) if many else rank_layout(req)
                self._layouts.put(req, layout)
            header = layout.header
            data = lease.segment.view(req.data_offset, round_up(data_len))
            path = pending.commit.path / name
            done: increment.Written | increment.Scan | None = None
            incremental = req.incremental and self.increments.enabled
            # The base is the newest LOCAL step now: an older save still being
            # written is not waited for (its successor compares with an older one).
            base = (
                increment.hold_base(self.catalog, pending, req.rank, self.increments)
                if incremental
                else None
            )
            if incremental and self.habits.scans(req, base):
                args_i = (path, header, data, data_len, layout, req, base)
                held_at = partial(increment.rank_file, self.store, req.job, name)
                done = await run(increment.write, *args_i, self.increments.max_files, held_at)
            if isinstance(done, increment.Written):
                record, shards = done.record, done.shards
                pending.nonfinite[req.rank] = done.nonfinite
                pending.increment = increment.chain_of(pending)
            else:
                digests = done.digests if done is not None else None
                spare = self.store.take_spare(len(layout.header) + data_len)
                args_w = (pending, req, layout, data, data_len, digests, spare)
                record, shards = await write_whole(run, *args_w)
            if incremental:  # the scan's answer, else a pass over crcs (a thread for many)
                args_a = (req, base, done, shards.crc32c)
                slow = many and done is None
                same = await run(increment.alike, *args_a) if slow else increment.alike(*args_a)
                self.habits.learn(req, base, same)
            if req.data_offset == 0 and self.memory is not None and self.memory.steps:
                pending.images[req.rank] = (len(header), checksum.value(header), data_len)
            pending.ranks[req.rank] = (record, shards, req.metadata)
        except order.Superseded:
            return  # ended by _supersede_older; its lease goes back below
        except Exception as exc:  # any failure fails the step, never the daemon
            # A trainer's copy that never completed is its failure, no bug: one line.
            how = log.warning if isinstance(exc, copied.Incomplete) else log.exception
            how("writing rank %d of %s/%d failed: %s", req.rank, req.job, req.step, exc)
            pending.writing.discard(req.rank)  # FAILED, with nothing in flight: a retry may begin
            await self._fail(pending, f"writing rank {req.rank} failed: {exc}")
            return
        finally:
            pending.writing.discard(req.rank)
            await self._settle(pending)
            if pending.superseded:  # nothing of it is kept: no record either
                self._forget_if_done(pending)
        if st.state == pb.SAVE_STATE_STAGING and set(pending.ranks) == set(st.node_ranks):
            await self._commit_step(pending)

    async def _commit_step(self, pending: PendingStep) -> None:
        try:
            await order.after_older(self._pending.values(), pending)
            await self._commit_in_order(pending)
        finally:
            pending.settled.set()

    def _supersede_older(self, newer: PendingStep) -> None:
        """End the job's older saves whose write has not begun: ``newer`` (every rank's
        bytes in, its handoff journaled) is written in their place (order.py)."""
        reason = order.SUPERSEDED_REASON.format(newer=newer.step.step)
        for gone in order.supersede_older(self._pending.values(), newer):
            self.catalog.failed(gone.step, reason, "local", newer=True)
            gone.settled.set()  # its ranks wake in order.turn and give their memory back
            # Nothing to remove: its directory is made only once its write begins.

    async def newest_written(self, job: str) -> None:
        """Wait until the job's newest fully handed-off save is LOCAL or ended."""
        await order.newest_written(self._pending.values(), job)

    async def _commit_in_order(self, pending: PendingStep) -> None:
        st = pending.step
        manifest = step_manifest(pending, self.node_id)
        try:
            await self._retire_replaced(pending)
            # Serialised once, on a thread: per-shard work never runs on the event loop,
            # and Restore answers reuse the same text.
            text = await self.io.run(manifest.to_json, ticket=pending.ticket)
            await pending.commit.finalize(text.encode())
        except Exception as exc:
            log.exception("committing %s/%d failed", st.job, st.step)
            await self._fail(pending, f"local commit failed: {exc}")
            return
        finally:
            self._forget_if_done(pending, force=True)
        # The memory goes back before LOCAL is announced, so whoever sees LOCAL can
        # save again at once (the journal's record is small and shared).
        self._settling.add(st.key)  # no await since the line above: no gap
        try:
            await self._settle(pending, committed=True, keep=True)
            self.catalog.committed(st, manifest)
        finally:
            self._settling.discard(st.key)
            pending.holds.close()  # its references are the catalog's to keep now
        log.info(
            "%s/%d LOCAL in %.3f s (%d bytes)",
            st.job,
            st.step,
            st.local_at - st.handoff_at,
            manifest.size_bytes,
        )

    async def _retire_replaced(self, pending: PendingStep) -> None:
        if pending.replaces is not None:
            await retire_replaced(self.catalog, self.store, self.io, pending.step, pending.ticket)
            pending.replaces = None

    async def _fail(self, pending: PendingStep, reason: str) -> None:
        try:
            await self._fail_step(pending, reason)
        finally:
            if pending.step.state == pb.SAVE_STATE_FAILED:
                pending.settled.set()

    async def _fail_step(self, pending: PendingStep, reason: str) -> None:
        if pending.step.state != pb.SAVE_STATE_STAGING:
            return
        # The memory of ranks no write still reads goes back before FAILED is
        # announced, so whoever sees FAILED can save again at once.
        await self._settle(pending, committed=True)
        # What was staged goes too before FAILED is announced: whoever sees FAILED
        # finds nothing partial left (removing it twice, if two ranks fail, is harmless).
        await pending.commit.abort()
        if pending.step.state != pb.SAVE_STATE_STAGING:
            return  # failed meanwhile by another rank
        self.catalog.failed(pending.step, reason, "local")
        pending.holds.close()
        await self._settle(pending)

    async def _settle(
        self, pending: PendingStep, committed: bool = False, keep: bool = False
    ) -> None:
        """Once the step is committed (renamed into place), LOCAL or FAILED, give back
        every lease no write still reads: journaled as done first, so a replay never
        reads a reused segment. ``keep``: the step committed; the memory tier may keep
        the leases instead (memory.py)."""
        if pending.step.state == pb.SAVE_STATE_STAGING and not committed:
            return
        if pending.timer is not None:
            pending.timer.cancel()
        done = {r: lease for r, lease in pending.leases.items() if r not in pending.writing}
        if not done:
            return
        for rank in done:
            del pending.leases[rank]
        ids = [lease.lease_id for lease in done.values()]
        try:
            await self.journal.done(ids)
        except Exception:
            # The records stay live on disk, so the segments must not be reused:
            # they are kept until a restart replays (and retires) them.
            log.exception("journal: cannot retire leases %s; keeping their memory", ids)
            return
        for rank, lease in done.items():
            if keep and lease.reuses and lease.holder:  # for that client's next save
                lease.segment.image = (pending.step.job, rank, pending.step.step, lease.holder)
            if not (keep and self._kept_in_memory(pending, rank, lease)):
                self.staging.release(lease.lease_id)

    def _kept_in_memory(self, pending: PendingStep, rank: int, lease: Lease) -> bool:
        """Offer a committed rank's lease to the memory tier; True if it kept it."""
        image, written = pending.images.get(rank), pending.ranks.get(rank)
        if self.memory is None or image is None or written is None:
            return False
        return self.memory.keep(pending.step, rank, lease, image, written[0].image_crc)

    def _forget_if_done(self, pending: PendingStep, force: bool = False) -> None:
        """Drop the bookkeeping of a save that committed, or failed with no write left."""
        ended = (pb.SAVE_STATE_FAILED, pb.SAVE_STATE_SUPERSEDED)
        failed = pending.step.state in ended and not pending.writing
        if (force or failed) and self._pending.get(pending.step.key) is pending:
            del self._pending[pending.step.key]
