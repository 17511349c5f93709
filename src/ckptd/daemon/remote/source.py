"""The bucket as a restore's tier: which steps it holds, a step made local again,
and other nodes' parts of a step for restores that reshard across nodes.

Every file is checked against its crc32c as it arrives and the copy is committed
locally (``manifest.json`` last, one rename) before anything reads it (read.py).

A step whose rank files reference older steps' (core/increments.py) comes with
them: each holder is brought first, as the complete step it is, through this same
verified path (its own holders first), so the local tier holds what the step
reads. A holder the bucket cannot give makes the step unrestorable; the restore
takes the next older step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from ckptd.core.errors import DataLoss, NotFound, Unavailable
from ckptd.core.format import round_up
from ckptd.core.manifest import MANIFEST, Manifest

from ..catalog import Step
from ..catalog.roles import Copies
from ..commit import RenameCommit
from ..files import read_small
from ..io import IoPool
from ..local.lease import Handed, Lease, Want
from ..local.prestaged import Prestaged
from ..local.store import LocalStore, retire_replaced
from . import held, read
from .base import Remote
from .index import NodeIndex
from .own import learn_own
from .ranged import Populate

log = logging.getLogger("ckptd.restore")

OTHER_STEPS = 3  # a job's newest steps a node with none of its own learns from the others


class BucketSource:
    """Bucket-to-local transfers for restores (``remote`` None: nothing to fetch from)."""

    name = "remote"

    def __init__(
        self,
        catalog: Copies,
        store: LocalStore,
        memory: Prestaged,
        io: IoPool,
        remote: Remote | None,
        index: NodeIndex | None,
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.memory = memory
        """Where a download's other ranks wait for their restores (the memory tier)."""
        self.io = io
        self.remote = remote
        self.index = index
        self._asked_others: set[str] = set()
        """Jobs whose newest steps were learnt from other nodes' markers in this life."""
        self._learnt: set[str] = set()
        self._fetching: dict[tuple[str, int], asyncio.Lock] = {}
        self.in_flight_bytes = 0
        """Bytes of the bucket fetches under way (``ckptd status``: restore progress)."""
        self.in_flight_done = 0
        """Of those, bytes already downloaded (counted per part as it lands)."""

    @contextlib.contextmanager
    def _counted(self, size: int) -> Iterator[Callable[[int], None]]:
        """Count one fetch of ``size`` bytes in the in-flight figures while it runs."""
        done = 0

        def progress(n: int) -> None:  # on the loop, like every reader of the figures
            nonlocal done
            done += n
            self.in_flight_done += n

        self.in_flight_bytes += size
        try:
            yield progress
        finally:
            self.in_flight_bytes -= size
            self.in_flight_done -= done

    def learnt(self, job: str) -> bool:
        """Whether :meth:`refresh` read what the bucket holds of ``job`` in this life."""
        return job in self._learnt

    async def refresh(self, job: str, step: int | None = None, others: bool = True) -> None:
        """Learn which steps of ``job`` the bucket holds complete, never by listing the
        job's objects (docs/scale.md): this node's steps from its index (one GET, the
        first time in this daemon's life; the drain and the evictor keep it current).
        A node with no step of its own there (a replacement under a new name) learns
        the job's newest steps from the other nodes' markers, once; a ``step`` asked
        for that is still unknown, from that step's markers. Not ``others``: this
        node's own steps only (what a first save must know: the other nodes' steps
        under its numbers are parts of the same saves, not earlier ones)."""
        if self.remote is None or self.index is None:
            return
        entries = await learn_own(self.catalog, self.index, job)
        if not others:
            return
        if not entries and job not in self._asked_others:
            self._asked_others.add(job)
            for n, found in (await read.newest_steps(self.remote, job, OTHER_STEPS)).items():
                read.tell(self.catalog, job, n, found)
        if step is not None and self.catalog.get(job, step) is None:
            await read.learn_step(self.remote, self.catalog, job, step)
        self._learnt.add(job)

    async def refresh_quietly(
        self, job: str, step: int | None = None, listing: bool = False, others: bool = True
    ) -> None:
        """:meth:`refresh`; a bucket that cannot be read is logged, and what is known
        is used (a restore or listing must not fail while the bucket is away). Until
        the node's index of ``job`` is read (with a jitter, in the background after a
        start), a restore the local tier answers does not wait for it; a ``listing``
        does (it shows every tier: after a node loss the local tier may hold only
        the step a peer gave back)."""
        if self.index is not None and not self.index.known(job) and not listing:
            if step is None and any(s.local for s in self.catalog.list(job)):
                return
            if step is not None and (st := self.catalog.get(job, step)) and st.local:
                return
        try:
            await self.refresh(job, step, others)
        except Exception as exc:
            log.warning("cannot read the bucket for job %s (%s); using the copies known", job, exc)

    async def other_nodes(self, st: Step) -> set[str]:
        """Every node whose part of ``st`` is complete in the bucket (its markers, listed:
        needed only to restore ranks this node's part does not hold)."""
        assert self.remote is not None
        nodes = await read.step_nodes(self.remote, st.job, st.step, st.adopted)
        if nodes:
            self.catalog.discovered(st.job, st.step, nodes, st.adopted, timeline=None)
        return set(self.catalog.require(st.job, st.step).remote_nodes)

    async def holds(self, job: str, step: int | None) -> list[tuple[bool, int, int]]:
        """The steps of ``job`` with a complete copy in the bucket that is not known to
        be corrupt, newest first (learnt first: :meth:`refresh_quietly`)."""
        if self.remote is None:
            return []
        await self.refresh_quietly(job, step)
        return [
            s.order
            for s in self.catalog.list(job)
            if s.in_remote and not s.unusable and (step is None or s.step == step)
        ]

    async def bring(self, job: str, step: int, want: Want) -> Handed | None:
        """:meth:`to_local` for a step the bucket holds; NotFound for one it does not."""
        st = self.catalog.get(job, step)
        if self.remote is None or st is None or not (st.in_remote or st.local):
            raise NotFound(f"the bucket holds no copy of {job}/{step}")
        lease = await self.to_local(st, want.rank, want.shared_memory)
        return Handed(lease) if lease is not None else None

    async def to_local(self, st: Step, rank: int | None, shared_memory: bool) -> Lease | None:
        """Download a remote-only step into the cache dir, verify it, commit it locally.
        A copy that does not verify marks the step unusable and raises DataLoss.
        ``rank`` None: this node's own part, whichever ranks it holds (a prefetch).

        With ``shared_memory``, every rank file of the node is downloaded through a
        segment when the budget allows: ``rank``'s lease is returned, the others are
        kept for those ranks' own Restore calls (which usually arrive together), so
        serving them needs no read back from disk. Unclaimed ones expire like any
        lease a client never used.
        """
        assert self.remote is not None
        lock = self._fetching.setdefault(st.key, asyncio.Lock())
        async with lock:
            if st.local:
                return None  # another restore fetched it meanwhile
            if self.index is not None and self.index.retracting(st.job, st.step):
                raise NotFound(f"retention is taking {st.job}/{st.step} out of the bucket")
            with self.catalog.in_use(st):  # the evictor leaves the bucket copy alone
                try:
                    return await self._fetch(st, rank, shared_memory)
                except (DataLoss, ValueError, KeyError, FileNotFoundError) as exc:
                    # The bucket's copy is corrupt, its manifest unreadable or naming
                    # files outside its step: marked here, for every caller (restore,
                    # ensure_local), so the next choice is an older step.
                    reason = f"its bucket copy does not verify: {exc}"
                    log.error("%s/%d: %s", st.job, st.step, reason)
                    self.catalog.unusable(st, reason)
                    raise DataLoss(
                        f"step {st.step} of job {st.job!r} cannot be restored: {reason}"
                    ) from None
                except Exception as exc:
                    if not self.remote.is_transient(exc):
                        raise
                    raise Unavailable(
                        f"step {st.step} of job {st.job!r} is only in {self.remote.url}, which "
                        f"does not answer ({type(exc).__name__}); restore it again once the "
                        "bucket is back, or restore a step this node holds"
                    ) from None

    async def _fetch(self, st: Step, rank: int | None, shared_memory: bool) -> Lease | None:
        assert self.remote is not None
        me = self.catalog.node_id
        known: set[str] = set()
        try:
            if st.adopted:  # one tree, every node's copy whole: any complete node
                known = set(st.remote_nodes)
            elif me in st.remote_nodes:  # the node's own part first: one GET
                known = {me}
            else:
                raise NotFound("not this node's part")
            # An adopted tree is whole on every node; else this rank's part of that
            # save (never a stale write of an earlier save under the number).
            part, save = (None, None) if st.adopted else (rank, st.timeline)
            node, raw, manifest = await read.node_manifest(
                self.remote, st.job, st.step, known, part, me, st.adopted, save
            )
        except NotFound:  # another node's part holds the rank: ask the step's records
            if rank is None:
                raise
            node, raw, manifest = await self._holder_manifest(st, rank, frozenset(known))
        await self._bring_holders(st, manifest, rank)
        # An incremental step's files are not the images a restore hands over: the
        # local tier assembles those from its holders' files too.
        shared_memory = shared_memory and not manifest.adopted
        shared_memory = shared_memory and not any(r.incremental for r in manifest.ranks)
        leases: dict[int, Lease] = {}
        by_file = {r.file: r for r in manifest.ranks}

        async def memory_for(name: str) -> tuple[memoryview, Populate | None] | None:
            record = by_file[name]
            got = await self.memory.lease_for(st.job, record.size) if shared_memory else None
            if got is None:
                return None
            leases[record.rank] = got
            seg = got.segment
            return seg.view(0, round_up(record.size)), None if seg.populated else seg.populate

        commit = await self.io.run(self.store.begin_step, st.job, st.step, self.io.run, True)
        try:
            with self._counted(manifest.size_bytes) as progress:
                await read.download_files(
                    self.remote,
                    st.job,
                    st.step,
                    node,
                    manifest,
                    commit.path,
                    progress,
                    memory_for=memory_for,
                )
            # The pages past each file's end too: a segment goes back to the pool whole.
            for held in leases.values():
                await self.io.run(held.segment.populate)
            # A local copy of an older save it replaces (a peer's, after a node loss) goes.
            await retire_replaced(self.catalog, self.store, self.io, st)
            await commit.finalize(raw)
        except BaseException:
            for held in leases.values():
                self.memory.release(held)
            await commit.abort()
            raise
        via = "shared memory" if leases else "disk"
        self.catalog.fetched(st, manifest, node=node, via=via)
        log.info(
            "%s/%d fetched from %s (node %s)%s and committed locally",
            st.job,
            st.step,
            self.remote.url,
            node,
            " through shared memory" if leases else "",
        )
        lease = leases.pop(rank, None) if rank is not None else None
        crcs = {r.rank: r.crc32c for r in manifest.ranks}
        for other, held in leases.items():
            self.memory.keep(st.job, st.step, other, held, (manifest.timeline, crcs[other]))
        return lease

    async def _bring_holders(self, st: Step, manifest: Manifest, rank: int | None) -> None:
        """Every step ``manifest`` references, made local first (oldest first; each
        brings its own). DataLoss if one is neither local nor restorable from the bucket."""
        holders = frozenset(manifest.holders())
        if not holders:
            return
        # Known from now on: while ``st`` is in use, retention keeps them (references.py).
        self.catalog.discovered(
            st.job, st.step, frozenset(), st.adopted, timeline=None, holders=holders
        )
        timelines = manifest.holder_timelines()
        for step in sorted(holders):
            h = self.catalog.get(st.job, step)
            if h is None or not (h.local or h.in_remote):
                await self.refresh(st.job, step)
                h = self.catalog.get(st.job, step)
            if h is None or h.timeline != timelines[step]:
                # Replaced by a later timeline's save: its files are held (held.py).
                await self._bring_held(st.job, step, timelines[step])
                continue
            if h.local:
                continue
            why = "it is not in the bucket"
            if h is not None and h.in_remote and not h.unusable:
                try:
                    await self.to_local(h, rank, False)
                    continue
                except (DataLoss, NotFound) as exc:
                    why = str(exc)
            elif h is not None and h.unusable:
                why = h.unusable
            raise DataLoss(
                f"step {step}, whose rank files it references, cannot be restored: {why}"
            )

    async def _bring_held(self, job: str, step: int, timeline: int) -> None:
        """A held copy this node's step reads, from the local tier's held copies or
        downloaded into them from the bucket (remote/held.py, local/held.py), verified
        like any download. DataLoss if neither has it."""
        assert self.remote is not None
        if self.store.held.has(job, step, timeline):
            return
        lock = self._fetching.setdefault((job, -1 - step), asyncio.Lock())
        async with lock:
            if self.store.held.has(job, step, timeline):
                return
            me = self.catalog.node_id
            try:
                raw, manifest = await held.held_manifest(self.remote, job, me, step, timeline)
            except FileNotFoundError:
                raise DataLoss(
                    f"step {step} of timeline {timeline}, whose rank files it references (a "
                    "later save replaced it), has no copy here or in the bucket"
                ) from None
            final = self.store.held.path(job, step, timeline)
            commit = RenameCommit.beside(
                final, self.store.cache_root, f"{job}.{step}.{timeline}", marker=MANIFEST,
                run=self.io.run,
            )  # fmt: skip
            try:
                with self._counted(manifest.size_bytes) as progress:
                    await read.download_files(
                        self.remote, job, step, me, manifest, commit.path, progress
                    )
                await commit.finalize(raw)
            except BaseException:
                await commit.abort()
                raise
            self.store.held.add(job, step, timeline)
            log.info("%s/%d (timeline %d): held copy fetched from %s", job, step, timeline,
                     self.remote.url)  # fmt: skip

    async def _holder_manifest(
        self, st: Step, rank: int, tried: frozenset[str] = frozenset()
    ) -> tuple[str, bytes, Manifest]:
        """The manifest of the node whose part of ``st`` holds ``rank``, the nodes whose
        ranks record names it first (usually the one GET), then every other complete
        node not ``tried`` already, in turn (a step drained before the ranks records)."""
        assert self.remote is not None
        if st.adopted:  # one tree, every node's copy whole: any complete node
            return await read.node_manifest(
                self.remote, st.job, st.step, await self.other_nodes(st), None, "", True
            )
        holders, complete = await read.rank_holders(self.remote, st.job, st.step, rank)
        if complete:
            self.catalog.discovered(st.job, st.step, complete, False, timeline=None)
        for node in holders:
            # Its part evicted since the listing, or not holding the rank after all.
            with contextlib.suppress(NotFound, FileNotFoundError):
                return await read.node_manifest(
                    self.remote, st.job, st.step, {node}, rank, node, False, st.timeline
                )
        rest = set(self.catalog.require(st.job, st.step).remote_nodes) - {*holders, *tried}
        me = self.catalog.node_id
        return await read.node_manifest(
            self.remote, st.job, st.step, rest, rank, me, False, st.timeline
        )

    async def other_parts(self, job: str, step: int) -> list[tuple[str, Path, str]]:
        """Other nodes' parts of ``step``, downloaded and verified once into
        ``<root>/.peers``: ``(node, directory, manifest json)`` each."""
        if self.remote is None:
            return []
        await self.refresh(job, step)
        st = self.catalog.require(job, step)
        parts = []
        lock = self._fetching.setdefault((job, -1 - step), asyncio.Lock())
        async with lock:
            with self.catalog.in_use(st):
                for node in sorted(await self.other_nodes(st) - {self.catalog.node_id}):
                    dest = self.store.peer_dir(job, step, node)
                    if not await self.io.run((dest / MANIFEST).exists):
                        await self._fetch_part(st, node)
                    raw = (await self.io.run(read_small, dest / MANIFEST)).decode()
                    await self._fetch_holders(job, node, raw)
                    parts.append((node, dest, raw))
        return parts

    async def _fetch_holders(self, job: str, node: str, raw: str) -> None:
        """The parts of older steps of ``node`` an incremental part's references read,
        fetched beside it (client/rank_files.py finds them there). References are
        never chained: their own holders are not needed."""
        if '"refs"' not in raw:
            return
        for holder in sorted(Manifest.from_json(raw).holders()):
            lock = self._fetching.setdefault((job, -1 - holder), asyncio.Lock())
            async with lock:  # older than the step whose lock is held: never a cycle
                if await self.io.run((self.store.peer_dir(job, holder, node) / MANIFEST).exists):
                    continue
                await self.refresh(job, holder)
                older = self.catalog.require(job, holder)
                with self.catalog.in_use(older):
                    await self._fetch_part(older, node)

    async def _fetch_part(self, st: Step, node: str) -> None:
        assert self.remote is not None
        # Only a part of the same save: a node that has not yet replaced its copy of an
        # earlier timeline's step under this number still has that one's.
        _, raw, manifest = await read.node_manifest(
            self.remote, st.job, st.step, {node}, None, node, st.adopted, st.timeline
        )
        commit = await self.io.run(self.store.begin_peer, st.job, st.step, node, self.io.run)
        try:
            with self._counted(manifest.size_bytes) as progress:
                await read.download_files(
                    self.remote, st.job, st.step, node, manifest, commit.path, progress
                )
            await commit.finalize(raw)
        except BaseException:
            await commit.abort()
            raise
        self.catalog.peers_fetched(st, node)
        log.info("%s/%d: fetched node %s's part from %s", st.job, st.step, node, self.remote.url)
