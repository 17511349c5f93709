"""Restore: the newest verified copy of a step, handed to the client.

The restorer is what the API calls: which steps count (the one asked for, the
newest, only healthy ones, adopted directories or arrays) and the answer's
shape. Which tier gives the chosen step is the chooser's (chooser.py), over the
tiers that each answer the same interface (tier.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from ckptd.core.errors import DataLoss, FailedPrecondition, NotFound
from ckptd.core.health import NONFINITE_METRIC
from ckptd.core.manifest import Manifest
from ckptd.proto import ckptd_pb2 as pb

from .. import faults
from ..catalog import Step
from ..catalog.roles import Steps
from ..local.lease import Want
from ..local.liveness import check_holder
from ..local.roles import Leases
from ..local.source import LocalSource
from ..local.staging import Lease
from ..local.store import LocalStore
from ..remote.source import BucketSource
from .chooser import Chooser

LISTING_WAIT_SECONDS = 5.0
"""Longest a listing waits for the first read of a job's index in the bucket: a hung
bucket must not hang `ckptd ls` or a framework's resume; the read goes on, and the
next listing shows what it found."""
SAVE_WAIT_SECONDS = 5.0
"""Longest a job's first save waits for its index (once: :meth:`Restorer.read_own_index`)."""


@dataclass(frozen=True)
class RestorePlan:
    """What the client gets: the step, and the shared-memory lease holding its data if any."""

    step: Step
    manifest: Manifest
    directory: Path
    lease: Lease | None
    data_offset: int
    tier: str = "local"
    """Where the copy came from: memory (the memory tier's kept segment), local, or
    remote (fetched from the bucket for it)."""
    holder_dirs: Mapping[int, Path] = field(default_factory=dict)
    """An incremental step's holders: the directory of each on the disk, its step's or
    its held copy where a later timeline replaced it (local/held.py)."""

    @property
    def reads(self) -> tuple[Path, ...]:
        """Every directory the client opens for this restore (access is granted to
        each): the step's, and an incremental rank's references, the same rank's
        file of an older step (client/rank_files.py) in that step's directory or its
        held copy. References are never chained, so the holders' own holders are
        never read for this step."""
        return (self.directory, *self.holder_dirs.values())


@dataclass(frozen=True)
class OtherPart:
    """Another node's part of a step, fetched here for a restore that reshards."""

    node: str
    directory: Path
    manifest_json: str
    reads: tuple[Path, ...]
    """Every directory a client reading the part opens (access is granted to each)."""


class Restorer:
    """Chooses what to restore and hands it to the client, verified."""

    def __init__(
        self,
        catalog: Steps,
        store: LocalStore,
        staging: Leases,
        chooser: Chooser,
        local: LocalSource,
        bucket: BucketSource,
        in_flight: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.staging = staging
        self.chooser = chooser
        self.local = local
        self.bucket = bucket
        """The bucket's other nodes' parts (:meth:`other_parts`), and whether there is one."""
        self.in_flight = in_flight
        """Waits until a job's newest acknowledged save is LOCAL or ended (the saver)."""
        self._index_reads: dict[str, asyncio.Future[None]] = {}
        self._own_reads: dict[str, tuple[asyncio.Future[None], float]] = {}
        """Each job's first read of its own index, and until when a save waits for it."""

    def choose(
        self,
        job: str,
        step: int | None,
        rank: int | None,
        adopted: bool = False,
        healthy: bool = False,
        offer: Callable[[str], bool] = lambda job: False,
    ) -> Step:
        """The newest (or given) step with a verified copy in some tier: a step of
        ckptd arrays holding ``rank``, or with ``adopted`` an adopted directory;
        with ``healthy``, one known to hold no NaN/Inf (core/health.py). ``offer``:
        the jobs a NotFound may name as the one probably meant (those the caller
        may read; by default none)."""
        if step is not None:
            st = self._named(job, step, adopted, healthy)
        else:
            st = self._newest(job, adopted, healthy, offer)
        held = {r.rank for r in st.manifest.ranks} if st.manifest is not None else None
        if rank is not None and held is not None and rank not in held:
            raise NotFound(
                f"step {st.step} of job {job!r} holds no shards of rank {rank} on this node"
            )
        return st

    def _named(self, job: str, step: int, adopted: bool, healthy: bool) -> Step:
        """The step asked for by number, if it can be restored as asked; a status that
        says why not otherwise."""
        st = self.catalog.require(job, step)
        if st.state == pb.SAVE_STATE_STAGING:
            raise FailedPrecondition(
                f"step {step} of job {job!r} is still being written; wait('local') first"
            )
        if st.manifest is None and not st.in_remote:
            raise FailedPrecondition(f"step {step} of job {job!r} failed: {st.error}")
        if st.unusable:
            raise DataLoss(f"step {step} of job {job!r} cannot be restored: {st.unusable}")
        if st.adopted and not adopted:
            raise FailedPrecondition(
                f"step {step} of job {job!r} is a directory adopted from "
                f"{st.manifest.source if st.manifest else 'another framework'}, not "
                "ckptd arrays: make it local with ckptd.client.orbax.ensure_local() "
                "(or `ckptd pull`) and restore it with the framework that wrote it"
            )
        if adopted and not st.adopted:
            raise FailedPrecondition(
                f"step {step} of job {job!r} was saved with Client.save, not adopted; "
                "restore it with Client.restore()"
            )
        if healthy and st.healthy is not True:
            raise FailedPrecondition(
                f"step {step} of job {job!r} is not known healthy ("
                f"{_health_text(st)}); restore it without healthy=True, or ask for "
                "no step to get the newest healthy one"
            )
        return st

    def _newest(self, job: str, adopted: bool, healthy: bool, offer: Callable[[str], bool]) -> Step:
        """The newest step of ``job`` that can be restored as asked (of the timeline
        it follows); NotFound that says what there is otherwise."""
        candidates = [
            s
            for s in self.catalog.list(job)
            if (s.local or s.in_remote)
            and s.adopted == adopted
            and not s.unusable
            and not s.abandoned  # a later timeline left it: restore(step=N) only
        ]
        sick = [s for s in candidates if s.healthy is not True] if healthy else []
        candidates = [s for s in candidates if s not in sick]
        if not candidates:
            where = "on this node or in the bucket" if self.bucket.remote else "on this node"
            what = "adopted step" if adopted else "restorable checkpoint"
            if sick:
                raise NotFound(
                    f"job {job!r} has no {what} known healthy {where}: "
                    + ", ".join(f"step {s.step} ({_health_text(s)})" for s in sick[:5])
                    + "; restore without healthy=True to take one anyway"
                )
            raise NotFound(f"job {job!r} has no {what} {where}{self._did_you_mean(job, offer)}")
        return candidates[0]

    async def learn(self, job: str) -> None:
        """Make what every tier holds of ``job`` known before it is listed (a node that
        lost its disk takes its newest step back from a peer)."""
        await self.read_index(job)
        await self.chooser.learn(job, None)

    async def read_index(self, job: str) -> None:
        """Read what the bucket holds of ``job`` (:meth:`BucketSource.refresh`), once in
        this daemon's life (later reads keep it current), waiting at most
        :data:`LISTING_WAIT_SECONDS`: a listing needs it."""
        if self.bucket.index is None or self.bucket.learnt(job):
            return
        read = self._index_reads.get(job)
        if read is None or read.done():
            read = asyncio.ensure_future(self.bucket.refresh_quietly(job, None, listing=True))
            self._index_reads[job] = read
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(read), LISTING_WAIT_SECONDS)

    async def read_own_index(self, job: str) -> None:
        """Read this node's own index of ``job`` before the job's first save here,
        waiting at most :data:`SAVE_WAIT_SECONDS`: the save's timeline follows this
        node's saves the bucket holds under the job's name (a node that lost its disk
        knows none of them until it reads). Tried once: a save does not wait twice
        for a bucket that did not answer (the drain reads it before the job's first
        upload). Unread by then, the job's next save is blind: it numbers its timeline
        above any the bucket can hold (core/timeline.py)."""
        index = self.bucket.index
        if index is None:
            return
        if index.known(job):  # read, here or by a listing or restore since
            self.catalog.sighted(job)
            return
        loop = asyncio.get_running_loop()
        if job not in self._own_reads:
            first = asyncio.ensure_future(self._read_own(job))
            first.add_done_callback(lambda _: self._sighted(job))
            deadline = loop.time() + SAVE_WAIT_SECONDS + index.jitter_seconds
            self._own_reads[job] = (first, deadline)
        read, deadline = self._own_reads[job]
        if read.done() or loop.time() >= deadline:
            return  # read, or tried: the first save's wait decided, once
        # The job's other ranks on this node wait for the same read, as long.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(read), max(0.0, deadline - loop.time()))
        if not index.known(job):  # away, or slow: the save cannot follow what it holds
            self.catalog.blind(job)

    def _sighted(self, job: str) -> None:
        if self.bucket.index is not None and self.bucket.index.known(job):
            self.catalog.sighted(job)  # read late: the job's next save need not be blind

    async def _read_own(self, job: str) -> None:
        if faults.armed("index.read_own"):  # a test holds the bucket's answer back
            await asyncio.to_thread(faults.hit, "index.read_own")
        await self.bucket.refresh_quietly(job, None, listing=True, others=False)

    async def prefetch(
        self, job: str, offer: Callable[[str], bool] = lambda job: False
    ) -> tuple[Step, str]:
        """Make this node's part of the newest step of ``job`` local (``ckptd
        prefetch``): from a peer, else the bucket; ``(step, where it came from)``.
        ``offer``: as :meth:`choose`'s."""
        brought = await self.chooser.learn(job, None)
        st = self.choose(job, None, None, offer=offer)
        if st.local:
            return st, brought or "local"
        if self.catalog.node_id not in st.remote_nodes:
            raise FailedPrecondition(
                f"step {st.step} of job {job!r} holds no part of this node in the bucket (a "
                "node under a new name): restore() fetches the ranks it needs from the others"
            )
        with self.catalog.in_use(st):
            served = await self.chooser.serve(st, Want(None), explicit=True)
        assert served is not None  # an explicit step is served or raises
        return st, served.tier

    def _did_you_mean(self, job: str, offer: Callable[[str], bool]) -> str:
        """A hint for a job name that is probably a typo, among the jobs ``offer``
        allows (another user's job names are never given); else the fresh-start advice."""
        others = [j for j in self.catalog.jobs() if j != job and offer(j)]
        close = difflib.get_close_matches(job, others, n=1, cutoff=0.6)
        if close:
            return f"; did you mean {close[0]!r}? (`ckptd ls` lists the jobs)"
        return "; start from scratch (or check the job name: `ckptd ls` lists the jobs)"

    async def restore(
        self,
        job: str,
        step: int | None,
        rank: int,
        shared_memory: bool,
        holder: str = "",
        owner: tuple[int, int] | None = None,
        healthy: bool = False,
        copy_on_write: bool = False,
        offer: Callable[[str], bool] = lambda job: False,
    ) -> RestorePlan:
        """Pick a step and, if asked and a segment is free, its rank's data in shared memory.
        ``holder``: the client's liveness file; its lease comes back if it dies.
        ``owner``: ``(uid, pid)`` of the client, the only process that may map it.
        ``healthy``: only a step known to hold no NaN/Inf. ``copy_on_write``: the
        client maps a segment the memory tier keeps copy-on-write. ``offer``: as
        :meth:`choose`'s."""
        check_holder(holder)  # before any memory is taken: a refusal leaves nothing held
        want = Want(rank, shared_memory, owner[0] if owner else None, copy_on_write, owner)
        if step is None and self.in_flight is not None:
            # The newest step is the one acknowledged last, though its write may still
            # run (a trainer killed right after a save): it is LOCAL in a moment.
            await self.in_flight(job)
        served = await self.chooser.restore(
            job, step, want, lambda: self.choose(job, step, rank, healthy=healthy, offer=offer)
        )
        st, handed = served.step, served.handed
        assert st.manifest is not None
        plan = RestorePlan(
            st,
            st.manifest,
            self.store.step_dir(job, st.step),
            handed.lease if handed else None,
            handed.offset if handed else 0,
            # The metric's labels: a copy taken from a peer or pre-staged is local.
            _label(served.tier, handed.lease if handed else None),
            {
                n: where
                for n, where in self.store.holder_dirs(
                    st.manifest, partial(self.catalog.local_timeline, job)
                ).items()
                if where is not None
            },
        )
        if plan.lease is not None and not self.staging.hold(plan.lease, holder, owner):
            # Another uid mapped that segment before: serve the verified file instead.
            plan = replace(plan, lease=None, data_offset=0, tier="local")
        if plan.lease is None or len(plan.manifest.ranks) > 1:
            # The client opens files of the step itself next (its own rank's, or other
            # local ranks' to reshard): the evictor leaves them alone for a while. A
            # rank whose whole file is in the lease needs none, and holding the step
            # back would keep retention from turning it into a spare for later saves.
            self.catalog.served(st)
            for held in self.catalog.references(st):
                older = self.catalog.get(job, held)
                if older is not None:  # its file is read too: no eviction meanwhile
                    self.catalog.served(older)
        return plan

    async def other_parts(self, job: str, step: int) -> list[OtherPart]:
        """Other nodes' parts of ``step``, verified into ``<root>/.peers`` for a restore
        that reshards across nodes, each with the directories a restoring client reads:
        the part's own and, for an incremental part, its holders' parts."""
        out = []
        for node, directory, raw in await self.bucket.other_parts(job, step):
            # (Parsed only when it references older steps: most parts are whole files.)
            held = Manifest.from_json(raw).holders() if '"refs"' in raw else ()
            holders = (directory.parent.parent / str(h) / directory.name for h in held)
            out.append(OtherPart(node, directory, raw, (directory, *holders)))
        return out

    async def report_corrupt(self, job: str, step: int, detail: str) -> None:
        """Re-verify a copy a client found corrupt; if bad, set it aside."""
        await self.local.report_corrupt(job, step, detail)


def _label(tier: str, lease: Lease | None) -> str:
    """The restore's tier as the metrics and the client see it."""
    if lease is not None and lease.shared:
        return "memory"
    return "remote" if tier == "remote" else "local"


def _health_text(st: Step) -> str:
    """What is known of a step's health, for errors."""
    if st.healthy is None:
        return "not counted: saved before ckptd counted NaN/Inf, or adopted"
    return f"{int(st.metrics[NONFINITE_METRIC])} NaN/Inf values"
