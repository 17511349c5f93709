"""The save path of a :class:`ckptd.client.Client`: plan, lease, copy, hand off; and
a lease a stager fills itself, handed off as it lies.

The client owns one :class:`Saver`; the saver holds only what saving needs (the
planner, the copy threads, the record of the previous save), and the client asks
it what :meth:`Client.should_save` needs to know about that previous save.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

from ckptd.core.errors import CapacityExhausted
from ckptd.core.format import TensorEntry, round_up
from ckptd.core.wire import Connection
from ckptd.proto import ckptd_pb2 as pb

from .ahead import Reserver
from .changes import Changes, Saved, incremental_from_env, packbits
from .copy_plan import CopyPlan, Routes
from .copying import copy_into, host_batches
from .handle import WATCHERS, SaveHandle
from .handoff import Copying, Handoff, lease_size
from .leaves.jax_arrays import Replicas, ShardPlan
from .planning import Arrays, Planner, SavePlan, plan_in_place
from .save_args import save_args

if TYPE_CHECKING:
    from .leaves.torch_device import DeviceCopies, Pending


_START_WAIT = 0.005
"""Seconds a save waits for its early lease's thread to start (see _lease_early)."""


class Saver:
    """Saves of one client: ``job`` as ``rank`` of ``node_ranks`` (``world_size`` in all).

    ``copy_threads`` copy large arrays into shared memory in parallel (1: on the
    calling thread only); ``staging_timeout`` is how long a save waits for staging
    memory; ``watched_stage`` says which stage of each save to start watching for
    the next save decision (the client's policy's); ``upload_interval`` the pace
    the daemon's drain uploads the job at (the policy's, 0: as fast as it can);
    ``incremental``: incremental saves unless ``CKPTD_INCREMENTAL=0`` (changes.py).
    """

    def __init__(
        self,
        handoff: Handoff,
        job: str,
        rank: int,
        node_ranks: Sequence[int],
        world_size: int,
        *,
        copy_threads: int | None,
        staging_timeout: float,
        save_replicas: Replicas,
        watched_stage: Callable[[], str],
        upload_interval: Callable[[], float] = lambda: 0.0,
        incremental: bool = True,
        trust_torch_versions: bool = False,
        trust_jax_arrays: bool = False,
    ) -> None:
        self.job = job
        self.rank = rank
        self.node_ranks = list(node_ranks)
        self.world_size = world_size
        self.staging_timeout = staging_timeout
        self.planner = Planner(save_replicas)
        self._handoff = handoff
        self._watched_stage = watched_stage
        self.supersede: bool | None = None  # Client's: None, while the stage is "memory"
        self._upload_interval = upload_interval
        # numpy releases the GIL while copying, so a few threads copy into the
        # lease faster than one (memory bandwidth, not CPU, is the limit). The
        # calling thread is one of them: the pool has one fewer.
        threads = copy_threads if copy_threads is not None else min(4, os.cpu_count() or 1)
        self._copy_threads = max(1, threads)
        self._copier = ThreadPoolExecutor(threads - 1, "ckptd-copy") if threads > 1 else None
        self._background = ThreadPoolExecutor(1, "ckptd-d2h")
        self._leaser = ThreadPoolExecutor(1, "ckptd-lease")
        self._committer = ThreadPoolExecutor(1, "ckptd-commit")
        self.ahead = Reserver(handoff, rank, self._leaser)
        """Staging memory made and mapped before the saves that take it (ahead.py)."""
        self._copy_job: Future[None] | None = None
        self._cuda: DeviceCopies | None = None
        self._routes = Routes(self.device_copies)
        self.last: SaveHandle | None = None
        """The previous save's handle (None before the first)."""
        self.last_at: float | None = None  # when it started (time.monotonic())
        self.last_bytes = 0  # its size in staging memory
        self._reached: set[str] = set()
        self._watch: dict[str, threading.Event] = {}
        self.incremental = incremental_from_env(incremental)
        """Incremental saves (changes.py): the trainer's word on unchanged shards, and
        no copy of those the leased segment already holds."""
        self.changes = Changes()
        self.trust_torch_versions = trust_torch_versions
        """Take a torch tensor whose storage and ``_version`` did not change as
        unchanged (changes.py): not copied, not compared. Off: the daemon compares
        digests, because some writes leave ``_version`` alone."""
        self.trust_jax_arrays = trust_jax_arrays
        """Take a jax array that is the same object as unchanged on every platform, and
        copy CPU arrays after save() returns (changes.py). Off: only where jax alone
        can write the memory (a TPU's); CPU arrays are copied before save() returns."""

    @property
    def connection(self) -> Connection:
        """The connection to the daemon (what a :class:`SaveHandle` waits on)."""
        return self._handoff.connection

    def previous_uploaded(self) -> bool:
        """Whether the previous save reached DURABLE (not only ended: a save the
        drain's pace skipped ends SUPERSEDED); as far as the watcher has seen."""
        return self.last is not None and "durable" in self.last.reached

    def previous_reached(self, stage: str) -> bool:
        """Has the previous save reached ``stage``? Never blocks, and costs no RPC per
        call: a watcher thread waits on the daemon (server-side) and flips a flag."""
        if self.last is None or stage == "memory" or stage in self._reached | self.last.reached:
            return True
        done = self._watch.get(stage)
        if done is None:
            done = self._watch[stage] = threading.Event()
            WATCHERS.watch(self.last, stage, done)
        if not done.is_set():
            return False
        self._reached.add(stage)
        return True

    def copy_arrays(
        self, mm: mmap.mmap, entries: list[TensorEntry], arrays: dict[str, Any]
    ) -> None:
        """Copy every array into its place in the lease (:func:`copy_into`)."""
        copy_into(mm, entries, arrays, self._copier, self._copy_threads)

    def save(
        self,
        step: int,
        tree: Any,
        metadata: dict[str, Any] | None = None,
        *,
        milestone: bool = False,
        metrics: dict[str, float] | None = None,
        staging_timeout: float | None = None,
    ) -> SaveHandle:
        """:meth:`Client.save`: plan ``tree``, lease, copy (what changed; jax arrays on
        an accelerator, or trusted ones, after returning) and hand it off as ``step``."""
        step, metrics, metadata_json = save_args(step, metrics, metadata)
        wait = self.staging_timeout if staging_timeout is None else staging_timeout
        track = self.incremental
        what = f"step {step} of job {self.job!r} was not saved"
        started = time.monotonic()
        plan, arrays, early = self._plan(tree, wait, what)
        self.finish_copy()  # one background copy at a time: it may use a mapped segment
        since = self.changes.last  # (the background commit of the last save is done)
        record = self.changes.begin(step)
        try:
            lease, mm = self._lease(early, lease_size(plan.data_len), wait, what, track)
        except CapacityExhausted as exc:
            raise CapacityExhausted(f"{what}: {exc}", exc.code) from None
        committed = False
        req = pb.CommitShardsRequest(lease_id=lease.lease_id)
        copies: CopyPlan | None = None
        job: Future[None] | None = None  # the copies and commit left to a thread
        try:
            # What the trainer says did not change since the last save, and of that what
            # the lease holds already: neither is copied again (changes.py).
            mask = self.changes.word(step, since, plan.keys, arrays.tokens)
            held = self.changes.held(lease, plan.entries, plan.keys, arrays.tokens, since, mask)
            copies = self._routes.plan(plan, arrays, held, mm, self.trust_jax_arrays, what)
            req = self._commit_request(req.lease_id, step, plan, metadata_json, milestone, metrics)
            req.incremental = self.incremental
            if mask is not None and since is not None:  # the trainer's word since `since`
                req.unchanged_since, req.unchanged = since, packbits(mask)
            saved = Saved(arrays.tokens, plan.entries) if record and arrays.tokens else None
            size, word = round_up(plan.data_len), lease.waits_for_word
            if copies.after_return:
                job = self._hand_off_copying(req, mm, size, word, copies, saved, what)
            else:
                copy = partial(self.copy_arrays, mm, copies.now, copies.host)
                self._handoff.commit_copying(req, mm, size, what, copy, self._committer, word)
                self.changes.acknowledged(step, saved)
            committed = True
        finally:
            if not committed:
                if copies is not None and copies.pending is not None:
                    copies.pending.wait()  # no copy may still write into a lease given back
                self._handoff.release(req.lease_id)  # the lease of the last attempt
        handle = SaveHandle(self, step, job)
        handle.reused_bytes = sum(e.length for e in plan.entries if e.key in held) if held else 0
        return self._saved(handle, started, lease_size(plan.data_len))

    def _plan(
        self, tree: Any, wait: float, what: str
    ) -> tuple[SavePlan, Arrays, tuple[int, Future[pb.Lease]] | None]:
        """Plan ``tree`` while the lease is asked for early (:meth:`_lease_early`); a
        plan that fails gives that lease back once granted."""
        track = self.incremental
        early = self._lease_early(wait, what, track)
        try:
            trust = self.trust_torch_versions, self.trust_jax_arrays
            plan, arrays = self.planner.plan(tree, track, *trust)
        except BaseException:
            if early is not None:
                early[1].add_done_callback(self._give_back)
            raise
        return plan, arrays, early

    def _hand_off_copying(
        self,
        req: pb.CommitShardsRequest,
        mm: mmap.mmap,
        size: int,
        word: bool,
        copies: CopyPlan,
        saved: Saved | None,
        what: str,
    ) -> Future[None]:
        """The commit goes out now, while this thread copies the host arrays and then a
        background job the rest (:meth:`Handoff.send_copying`); that job, which from
        now on waits for the queued CUDA copies (``copies.pending`` is cleared)."""
        self._routes.start_transfers(copies)
        sending: Copying | None = None
        try:
            sending = self._handoff.send_copying(req, mm, size, what, self._committer, word)
            self.copy_arrays(mm, copies.now, copies.host)
            job = self._copy_job = self._background.submit(
                self._copy_device_and_commit,
                mm,
                copies.later,
                copies.device,
                req,
                size,
                saved,
                copies.pending,
                sending,
            )
        except BaseException:
            if sending is not None:
                if copies.pending is not None:  # none may write into a lease given up
                    copies.pending.wait_all()
                sending.done(whole=False)
            raise
        copies.pending = None  # the background job waits for it
        return job

    def _lease_early(
        self, wait: float, what: str, reuse_image: bool
    ) -> tuple[int, Future[pb.Lease]] | None:
        """Ask for the lease of the save being planned on a thread, sized as the last
        save was (a training loop saves the same state): the daemon answers while this
        thread flattens the tree, instead of after (~2 ms of the trainer's blocking
        time on a state of a thousand tensors). None for the first save."""
        last = self.planner.last
        if last is None:
            return None
        size = lease_size(last.data_len)
        started = threading.Event()

        def ask() -> pb.Lease:
            started.set()
            return self._handoff.request(size, wait, what, self.rank, reuse_image)

        asked = self._leaser.submit(ask)
        # Until that thread runs into the call (which lets go of the GIL), planning
        # would hold the GIL and the thread would start only when it is done (~1.5 ms).
        # Not longer than a few ms: the thread may still be busy with the lease of a
        # save whose planning failed, waiting for staging memory.
        started.wait(_START_WAIT)
        return size, asked

    def _lease(
        self,
        early: tuple[int, Future[pb.Lease]] | None,
        size: int,
        wait: float,
        what: str,
        reuse_image: bool,
    ) -> tuple[pb.Lease, mmap.mmap]:
        """The save's lease, mapped: the early one if it has the size the plan needs
        (else it goes back), or one asked for now."""
        if early is not None:
            try:
                lease = early[1].result()
            except CapacityExhausted:
                if early[0] == size:
                    raise
                # Refused at the last save's size (a disk floor, a full budget): this
                # save's own size may fit.
            else:
                if early[0] == size:
                    return self._handoff.map(lease)
                self._handoff.release(lease.lease_id)
        return self.ahead.acquire(size, wait, what, reuse_image)  # after a reservation

    def _give_back(self, early: Future[pb.Lease]) -> None:
        """Release a lease asked for early once it is granted (its save failed)."""
        if not early.cancelled() and early.exception() is None:
            self._handoff.release(early.result().lease_id)

    def _commit_request(
        self,
        lease_id: str,
        step: int,
        plan: SavePlan,
        metadata_json: str,
        milestone: bool,
        metrics: dict[str, float],
    ) -> pb.CommitShardsRequest:
        return pb.CommitShardsRequest(
            lease_id=lease_id,
            job=self.job,
            step=step,
            rank=self.rank,
            node_ranks=self.node_ranks,
            world_size=self.world_size,
            data_offset=0,
            table=plan.table,
            tree_json=plan.tree_json,
            metadata_json=metadata_json,
            milestone=milestone,
            metrics=metrics,
            upload_interval_seconds=self._upload_interval(),
            supersede=self._supersedes(),
        )

    def _supersedes(self) -> bool:
        return self._watched_stage() == "memory" if self.supersede is None else self.supersede

    def reserve(self, tree: Any) -> Future[int]:
        """:meth:`Client.reserve`: plan ``tree``; its first saves' segments made ahead."""
        trust = self.trust_torch_versions, self.trust_jax_arrays
        plan, _ = self.planner.plan(tree, self.incremental, *trust)
        return self.ahead.first_saves(lease_size(plan.data_len))

    def _saved(self, handle: SaveHandle, started: float, size: int) -> SaveHandle:
        """Bookkeeping after a handoff: the last save, for should_save(); after the
        first, the second's segment made and mapped ahead (ahead.py)."""
        if self.last is None:
            self.ahead.after_first(size)
        self.last, self.last_at, self.last_bytes = handle, started, size
        self._reached, self._watch = set(), {}
        # Start watching now, so a save that reaches the stage before the next
        # should_save() is seen there at once.
        self.previous_reached(self._watched_stage())
        return handle

    # -- saving memory a stager filled itself -----------------------------------
    def lease(
        self, size_bytes: int, staging_timeout: float | None = None
    ) -> tuple[pb.Lease, mmap.mmap]:
        """A lease of at least ``size_bytes`` and its mapping, for a stager that copies
        a state into it itself (DCP's ``async_save`` through ckptd) and then hands it
        off with :meth:`commit_in_place` or gives it back with :meth:`release`."""
        wait = self.staging_timeout if staging_timeout is None else staging_timeout
        what = f"no shared memory for a save of job {self.job!r}"
        return self._handoff.acquire(round_up(max(1, size_bytes)), wait, what)

    def release(self, lease: pb.Lease) -> None:
        """Give back a lease from :meth:`lease` that will not be committed."""
        self._handoff.release(lease.lease_id)

    def commit_in_place(
        self,
        step: int,
        tree: Any,
        lease: pb.Lease,
        mm: mmap.mmap,
        metadata: dict[str, Any] | None = None,
        *,
        milestone: bool = False,
        metrics: dict[str, float] | None = None,
    ) -> SaveHandle | None:
        """Hand off ``tree`` as ``step`` with no copy: its array leaves are views of
        ``mm`` (the mapping of ``lease``) lying back to back from its start. Returns
        None, committing nothing (the lease is still held), if they do not lie so."""
        step, metrics, metadata_json = save_args(step, metrics, metadata)
        plan = plan_in_place(tree, mm)
        if plan is None:
            return None
        started = time.monotonic()
        self.changes.begin(step)  # no tokens: the daemon compares digests
        req = self._commit_request(lease.lease_id, step, plan, metadata_json, milestone, metrics)
        req.incremental = self.incremental
        self._handoff.commit(req, mm, len(mm), f"step {step} of job {self.job!r} was not saved")
        return self._saved(SaveHandle(self, step), started, round_up(plan.data_len))

    def _copy_device_and_commit(
        self,
        mm: mmap.mmap,
        entries: list[TensorEntry],
        device: dict[str, ShardPlan],
        req: pb.CommitShardsRequest,
        size: int,
        saved: Saved | None,
        pending: Pending | None = None,
        sending: Copying | None = None,
    ) -> None:
        """Background: device-to-host copies into the lease (CUDA tensors' are queued
        already: ``pending``), then the word of the commit ``sending`` while they ran
        (:meth:`Handoff.send_copying`), or the commit."""
        what = f"step {req.step} of job {self.job!r} was not saved"

        def copy() -> None:
            if pending is not None:
                pending.wait()
            for batch, hosts in host_batches(entries, device, what):
                self.copy_arrays(mm, batch, hosts)

        try:
            self._handoff.commit_copied(sending, req, mm, size, what, copy)
            self.changes.acknowledged(req.step, saved)
        except BaseException:
            self._handoff.release(req.lease_id)
            raise

    def device_copies(self) -> DeviceCopies:
        """The copier of CUDA tensors into leases (made at the first save holding one:
        only then is torch known to be imported)."""
        if self._cuda is None:
            from .leaves.torch_device import DeviceCopies

            self._cuda = DeviceCopies()
            self._handoff.unmapping.append(self._cuda.forget)
        return self._cuda

    def finish_copy(self) -> None:
        """Wait for the background device-to-host copy of the last save, if any."""
        if self._copy_job is not None:
            self._copy_job.exception()  # wait; its handle reports any error
            self._copy_job = None

    def close(self) -> None:
        """Finish the last save's copy and stop the copy threads."""
        self.finish_copy()
        self._background.shutdown(wait=True)
        self._leaser.shutdown(wait=True)
        self._committer.shutdown(wait=True)
        if self._cuda is not None:
            self._cuda.close()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
