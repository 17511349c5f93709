"""Restore: choose the newest verified copy and hand it to the client.

Two ways to hand over a rank's data, both verified against the crc32c recorded
at commit before the client sees a byte:

- into shared memory (preferred): the daemon reads the rank file's data section
  with aligned ``O_DIRECT`` reads into one of its free, already faulted staging
  segments, checks every shard's crc32c, and lends the segment to the client,
  whose arrays are views over it. No page cache is allocated, which is what
  makes cold restores fast on these VMs (docs/architecture.md, "Performance notes").
  Once the client has mapped it, the segment is the trainer's memory: the
  daemon unlinks it and drops it from its pool and staging budget, so restored
  arrays the trainer keeps (an optimizer's state) never hold a lease.
- the file: when no free segment fits, the client maps the file copy-on-write
  and checks the crc32c itself, reporting a mismatch with ReportCorrupt.

A copy that fails its check is moved to ``<root>/.corrupt`` (removed at the next
start) and the next newest intact step is offered instead, unless the caller
asked for that exact step.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import logging
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

from ckptd.core import checksum
from ckptd.core.checksum import verify_step
from ckptd.core.errors import DataLoss, FailedPrecondition, NotFound
from ckptd.core.format import round_up
from ckptd.core.health import NONFINITE_METRIC
from ckptd.core.manifest import Manifest, RankRecord
from ckptd.core.shard_table import ShardTable
from ckptd.proto import ckptd_pb2 as pb

from .. import faults
from ..catalog import Catalog, Step
from ..files import data_offset, read_data_direct, read_header
from ..io import CRC, IoPool
from ..local.liveness import check_holder
from ..local.staging import Lease, Staging
from ..local.store import LocalStore
from ..peer.fetch import PeerFetcher
from .fetcher import Fetcher

log = logging.getLogger("ckptd.restore")

EVICTION_WAIT_SECONDS = 5.0
"""How long a restore that lost its chosen copy to the evictor waits for the catalog
to say so (the eviction is already under way: normally milliseconds)."""


@dataclass(frozen=True)
class RestorePlan:
    """What the client gets: the step, and the shared-memory lease holding its data if any."""

    step: Step
    manifest: Manifest
    directory: Path
    lease: Lease | None
    data_offset: int
    tier: str = "local"
    """Where the copy came from: local, or remote (fetched from the bucket for it)."""


class Restorer:
    """Chooses what to restore and hands it to the client, verified."""

    def __init__(
        self,
        catalog: Catalog,
        store: LocalStore,
        staging: Staging,
        io: IoPool,
        fetcher: Fetcher,
        peer: PeerFetcher | None = None,
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.staging = staging
        self.io = io
        self.fetcher = fetcher
        self.peer = peer
        """The peer tier, asked before the bucket when no local copy is there."""

    def choose(
        self,
        job: str,
        step: int | None,
        rank: int | None,
        adopted: bool = False,
        healthy: bool = False,
    ) -> Step:
        """The newest (or given) step with a verified copy in some tier: a step of
        ckptd arrays holding ``rank``, or with ``adopted`` an adopted directory;
        with ``healthy``, one known to hold no NaN/Inf (core/health.py)."""
        if step is not None:
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
        else:
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
                where = "on this node or in the bucket" if self.fetcher.remote else "on this node"
                what = "adopted step" if adopted else "restorable checkpoint"
                if sick:
                    raise NotFound(
                        f"job {job!r} has no {what} known healthy {where}: "
                        + ", ".join(f"step {s.step} ({_health_text(s)})" for s in sick[:5])
                        + "; restore without healthy=True to take one anyway"
                    )
                raise NotFound(f"job {job!r} has no {what} {where}{self._did_you_mean(job)}")
            st = candidates[0]
        held = {r.rank for r in st.manifest.ranks} if st.manifest is not None else None
        if rank is not None and held is not None and rank not in held:
            raise NotFound(
                f"step {st.step} of job {job!r} holds no shards of rank {rank} on this node"
            )
        return st

    async def prefetch(self, job: str) -> tuple[Step, str]:
        """Make this node's part of the newest step of ``job`` local (``ckptd
        prefetch``): from a peer, else the bucket; ``(step, where it came from)``."""
        await self.fetcher.refresh_quietly(job)
        from_peer = self.peer is not None and await self.peer.ensure(job, again=True)
        st = self.choose(job, None, None)
        if st.local:
            return st, "peer" if from_peer else "local"
        if self.catalog.node_id not in st.remote_nodes:
            raise FailedPrecondition(
                f"step {st.step} of job {job!r} holds no part of this node in the bucket (a "
                "node under a new name): restore() fetches the ranks it needs from the others"
            )
        with self.catalog.in_use(st):
            await self.fetcher.to_local(st, None, False)
        return st, "remote"

    def _did_you_mean(self, job: str) -> str:
        """A hint for a job name that is probably a typo; else the fresh-start advice."""
        others = [j for j in self.catalog.jobs() if j != job]
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
    ) -> RestorePlan:
        """Pick a step and, if asked and a segment is free, read it into shared memory.
        ``holder``: the client's liveness file; its lease comes back if it dies.
        ``owner``: ``(uid, pid)`` of the client, the only process that may map it.
        ``healthy``: only a step known to hold no NaN/Inf."""
        uid = owner[0] if owner else None
        check_holder(holder)  # before any memory is taken: a refusal leaves nothing held
        plan = await self._restore(job, step, rank, shared_memory, uid, healthy)
        if plan.lease is not None and not self.staging.hold(plan.lease, holder, owner):
            # Another uid mapped that segment before: serve the verified file instead.
            plan = replace(plan, lease=None, data_offset=0)
        return plan

    async def _restore(
        self,
        job: str,
        step: int | None,
        rank: int,
        shared_memory: bool,
        uid: int | None,
        healthy: bool,
    ) -> RestorePlan:
        # No request when the node's index of the job is read already (at start-up, for
        # every job held locally): a restarting job's nodes that hold their steps never
        # touch the bucket.
        await self.fetcher.refresh_quietly(job, step)
        if self.peer is not None:  # a node that lost its disk: a peer before the bucket
            await self.peer.ensure(job, step)
        while True:
            st = self.choose(job, step, rank, healthy=healthy)
            # Held while the daemon reads it: the evictor leaves it alone. (The grace
            # for files the client opens itself comes from the servicer: see served.)
            with self.catalog.in_use(st):
                plan = await self._attempt(st, step, rank, shared_memory, uid)
            if plan is not None:
                return plan

    async def _attempt(
        self, st: Step, step: int | None, rank: int, shared_memory: bool, uid: int | None
    ) -> RestorePlan | None:
        """Serve one chosen step; None: it could not be, choose again."""
        job, tier = st.job, "local"
        if st.manifest is None and self.peer is not None:
            # The part holding the rank from a peer's replica, before the bucket (a
            # replacement node under a new name restores its predecessor's part).
            await self.peer.ensure_part(st, rank)
        if st.manifest is None:
            try:
                lease = await self.fetcher.to_local(st, rank, shared_memory)
            except DataLoss:
                # The bucket's copy is corrupt (or its manifest unreadable or unsafe)
                # and there is no local one: the fetcher marked the step unusable;
                # restore an older one, unless this one was asked for.
                if step is not None:
                    raise
                log.error("%s/%d cannot be fetched; restoring an older step", job, st.step)
                return None
            assert st.manifest is not None
            tier = "remote"
            if lease is not None:  # the whole verified file is in the lease already
                directory = self.store.step_dir(job, st.step)
                return RestorePlan(st, st.manifest, directory, lease, 0, tier)
        assert st.manifest is not None
        directory = self.store.step_dir(job, st.step)
        prefetched = self.fetcher.take_prefetched(job, st.step, rank)
        if prefetched is not None:
            return RestorePlan(st, st.manifest, directory, prefetched, 0, tier)
        if not shared_memory:
            return RestorePlan(st, st.manifest, directory, None, 0, tier)
        record = next(r for r in st.manifest.ranks if r.rank == rank)
        path = directory / record.file
        changed = st.changed
        try:
            offset = await self.io.run(_data_offset, path)
            lease = self.staging.take_free(job, round_up(record.size - offset), uid)
        except (OSError, ValueError) as exc:
            if not await self._evicted(st, exc, changed):
                await self._set_aside(st, [f"{record.file}: {exc}"], explicit=step is not None)
            return None
        if lease is None:
            return RestorePlan(st, st.manifest, directory, None, 0, tier)
        try:
            bad = await self.io.run(
                _read_and_verify, path, offset, record, lease, st.manifest.shards
            )
        except BaseException as exc:
            self.staging.release(lease.lease_id)
            if await self._evicted(st, exc, changed):
                return None
            raise
        if not bad:
            return RestorePlan(st, st.manifest, directory, lease, offset, tier)
        self.staging.release(lease.lease_id)
        await self._set_aside(st, bad, explicit=step is not None)
        return None

    async def _evicted(self, st: Step, exc: BaseException, changed: asyncio.Event) -> bool:
        """Whether ``exc`` is the evictor removing the copy this restore chose just
        before it was marked served (its files renamed away: not corruption). If so,
        wait until the catalog says so (``changed``: its event when chosen), so the
        next choice is another copy; an eviction that failed wakes us by the timeout."""
        if not (isinstance(exc, FileNotFoundError) and (st.evicting or not st.local)):
            return False
        log.info("%s/%d was evicted while a restore chose it; choosing again", st.job, st.step)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), EVICTION_WAIT_SECONDS)
        return True

    def lend(self, lease_id: str) -> None:
        """The client mapped a restore lease: the segment is its memory from now on."""
        self.staging.lend(lease_id)

    async def report_corrupt(self, job: str, step: int, detail: str) -> None:
        """Re-verify a copy a client found corrupt; if bad, set it aside."""
        st = self.catalog.require(job, step)
        if st.manifest is None:
            raise FailedPrecondition(f"step {step} of job {job!r} has no local copy")
        bad = await self.io.run(verify_step, self.store.step_dir(job, step), st.manifest)
        if not bad:
            raise FailedPrecondition(
                f"step {step} of job {job!r} re-read with matching checksums; the client's "
                f"mismatch ({detail[:200]}) was not reproduced"
            )
        await self._set_aside(st, bad, explicit=False)

    async def _set_aside(self, st: Step, bad: list[str], explicit: bool) -> None:
        log.error(
            "local copy of %s/%d is corrupt (%s); setting it aside in .corrupt",
            st.job,
            st.step,
            "; ".join(bad[:5]),
        )
        await self.io.run(self.store.set_aside, st.job, st.step)
        # With a remote copy the bucket's is fetched and served instead.
        self.catalog.local_removed(st, pb.STEP_EVENT_SET_ASIDE, "; ".join(bad[:5]))
        if explicit and not st.in_remote:
            raise DataLoss(
                f"the local copy of step {st.step} of job {st.job!r} failed its checksum "
                f"({bad[0]}) and was set aside; no other copy exists on this node. "
                "restore() without a step picks the newest intact one"
            )


def _data_offset(path: Path) -> int:
    faults.hit("restore.open")  # chosen and marked served, the file not yet opened
    return data_offset(path)


def _read_and_verify(
    path: Path, offset: int, record: RankRecord, lease: Lease, table: ShardTable
) -> list[str]:
    """Read a rank file's data section into ``lease`` and check it against the crc32c
    recorded at commit; returns what does not match (empty if intact).

    The whole file's crc is checked (header + data): each chunk's crc runs on
    another thread while the next chunk is read, and the pieces are combined, so
    verifying costs no per-shard work and little time beyond the read. Only a
    mismatch is narrowed down to the shards that differ.
    """
    faults.hit("restore.read")
    length = record.size - offset
    if not 8 <= offset <= min(record.size, MAX_HEADER_BYTES):
        return [f"{record.file}: a header of {offset} bytes does not fit the file"]
    view = lease.segment.view(0, round_up(length))
    pieces: list[tuple[Future[int], int]] = []

    def crc_of(pos: int, n: int) -> None:
        pieces.append((CRC.submit(checksum.value, view[pos : pos + n]), n))

    try:
        header = read_header(path, offset)
        read_data_direct(path, offset, length, view, VERIFY_CHUNK, crc_of)
    except ValueError as exc:  # short: corrupt (an OSError is the disk's, and is raised)
        return [f"{record.file}: {exc}"]
    finally:
        crcs = [(future.result(), n) for future, n in pieces]  # the view stays read
    whole = checksum.combine(checksum.value(header), checksum.combine_all(crcs), length)
    if whole == record.crc32c:
        return []
    shards = table.of_rank(record.rank)
    ranges = list(zip((shards.offset - offset).tolist(), shards.length.tolist(), strict=True))
    got = checksum.of_ranges(view, ranges)
    want = shards.crc32c.tolist()
    bad = [f"{record.file}:{k}" for k, c, w in zip(shards.keys, got, want, strict=True) if c != w]
    return bad or [f"{record.file}: its header or padding differs from the commit"]


VERIFY_CHUNK = 8 * 2**20
"""Bytes read per call when restoring: the crc of one runs while the next is read."""
MAX_HEADER_BYTES = 100 * 2**20
"""Largest safetensors header (the format's own limit)."""


def _health_text(st: Step) -> str:
    """What is known of a step's health, for errors."""
    if st.healthy is None:
        return "not counted: saved before ckptd counted NaN/Inf, or adopted"
    return f"{int(st.metrics[NONFINITE_METRIC])} NaN/Inf values"
