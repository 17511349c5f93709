"""Restore: choose the newest verified copy and hand it to the client.

Two ways to hand over a rank's data, both verified against the crc32c recorded
at commit before the client sees a byte:

- into shared memory (preferred): the daemon reads the rank file's data section
  with aligned ``O_DIRECT`` reads into one of its free, already faulted staging
  segments, checks every shard's crc32c, and lends the segment to the client,
  whose arrays are views over it. No page cache is allocated, which is what
  makes cold restores fast on these VMs (see DESIGN.md, Performance notes).
  The client holds a shared flock on the segment while any array uses it; the
  daemon takes it back for later saves only once that lock is gone.
- the file: when no free segment fits, the client maps the file copy-on-write
  and checks the crc32c itself, reporting a mismatch with ReportCorrupt.

A copy that fails its check is moved to ``<root>/.corrupt`` (removed at the next
start) and the next newest intact step is offered instead, unless the caller
asked for that exact step.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ckptd.client.format import round_up
from ckptd.proto import ckptd_pb2 as pb

from . import fetch, localstore
from .errors import DataLoss, FailedPrecondition, NotFound, ResourceExhausted
from .localstore import MANIFEST
from .manifest import Manifest, ShardRecord
from .node import Node, StepState
from .remote import Remote
from .staging import Lease

log = logging.getLogger("ckptd.restore")


@dataclass(frozen=True)
class RestorePlan:
    """What the client gets: the step, and the shared-memory lease holding its data if any."""

    step: StepState
    manifest: Manifest
    directory: Path
    lease: Lease | None
    data_offset: int


class Restorer:
    """Restore-side operations of a :class:`Node`."""

    def __init__(self, node: Node, remote: Remote | None = None) -> None:
        self.node = node
        self.remote = remote
        self._fetching: dict[tuple[str, int], asyncio.Lock] = {}
        self._prefetched: dict[tuple[str, int, int], Lease] = {}
        """Verified restore leases of other ranks, filled by a fetch from the bucket."""

    def choose(
        self, job: str, step: int | None, rank: int | None, adopted: bool = False
    ) -> StepState:
        """The newest (or given) step with a verified copy in some tier: a step of
        ckptd arrays holding ``rank``, or with ``adopted`` an adopted directory."""
        node = self.node
        if step is not None:
            st = node.get_step(job, step)
            if st.state == pb.SAVE_STATE_STAGING:
                raise FailedPrecondition(
                    f"step {step} of job {job!r} is still being written; wait('local') first"
                )
            if st.manifest is None and not st.in_remote:
                raise FailedPrecondition(f"step {step} of job {job!r} failed: {st.error}")
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
        else:
            candidates = [
                s
                for s in node.list(job)
                if (s.manifest is not None or s.in_remote) and s.adopted == adopted
            ]
            if not candidates:
                where = "on this node or in the bucket" if self.remote else "on this node"
                what = "adopted step" if adopted else "restorable checkpoint"
                raise NotFound(f"job {job!r} has no {what} {where}; start from scratch")
            st = candidates[0]
        held = {r.rank for r in st.manifest.ranks} if st.manifest is not None else None
        if rank is not None and held is not None and rank not in held:
            raise NotFound(
                f"step {st.step} of job {job!r} holds no shards of rank {rank} on this node"
            )
        return st

    async def refresh_remote(self, job: str) -> None:
        """Learn which steps of ``job`` the bucket holds complete (other nodes' too)."""
        if self.remote is None:
            return
        for step, found in (await fetch.complete_steps(self.remote, job)).items():
            st = self.node.steps.get((job, step))
            if st is None:
                st = self.node.steps[(job, step)] = StepState(job, step, pb.SAVE_STATE_DURABLE)
            st.remote_nodes |= found.nodes
            st.adopted = st.adopted or found.adopted

    async def fetch_to_local(self, st: StepState, rank: int, shared_memory: bool) -> Lease | None:
        """Download a remote-only step into the cache dir, verify it, commit it locally.

        With ``shared_memory``, every rank file of the node is downloaded through a
        segment when the budget allows: ``rank``'s lease is returned, the others are
        kept for those ranks' own Restore calls (which usually arrive together), so
        serving them needs no read back from disk. Unclaimed ones expire like any
        lease a client never used.
        """
        assert self.remote is not None
        lock = self._fetching.setdefault((st.job, st.step), asyncio.Lock())
        async with lock:
            if st.manifest is not None:
                return None  # another restore fetched it meanwhile
            st.busy += 1  # the evictor leaves the bucket copy alone meanwhile
            try:
                return await self._fetch(st, rank, shared_memory)
            finally:
                st.busy -= 1

    async def _fetch(self, st: StepState, rank: int, shared_memory: bool) -> Lease | None:
        assert self.remote is not None
        node, raw, manifest = await fetch.node_manifest(
            self.remote,
            st.job,
            st.step,
            st.remote_nodes,
            None if st.adopted else rank,
            self.node.config.node_id,
            st.adopted,
        )
        shared_memory = shared_memory and not manifest.adopted
        leases: dict[int, Lease] = {}
        by_file = {r.file: r for r in manifest.ranks}

        async def memory_for(name: str) -> memoryview | None:
            record = by_file[name]
            got = await self._restore_lease(st.job, record.size) if shared_memory else None
            if got is None:
                return None
            leases[record.rank] = got
            return got.segment.view(0, round_up(record.size))

        store = self.node.store
        tmp = await self.node.run_io(store.new_cache_dir, st.job, st.step)
        try:
            await fetch.download_step(
                self.remote, st.job, st.step, node, raw, manifest, tmp, memory_for=memory_for
            )
            await self.node.run_io(store.install, tmp, st.job, st.step)
        except BaseException:
            for held in leases.values():
                self.node.staging.release(held.lease_id)
            await self.node.run_io(store.discard, tmp)
            raise
        st.manifest, st.local_at = manifest, time.time()
        st.milestone = st.milestone or manifest.milestone
        st.created_unix, st.metrics = manifest.created_unix, dict(manifest.metrics)
        log.info(
            "%s/%d fetched from %s (node %s)%s and committed locally",
            st.job,
            st.step,
            self.remote.url,
            node,
            " through shared memory" if leases else "",
        )
        lease = leases.pop(rank, None)
        for other, held in leases.items():
            self._prefetched[(st.job, st.step, other)] = held
        return lease

    async def fetch_peers(self, job: str, step: int) -> list[tuple[str, Path, str]]:
        """Other nodes' parts of ``step``, downloaded and verified once into
        ``<root>/.peers``: ``(node, directory, manifest json)`` each."""
        if self.remote is None:
            return []
        await self.refresh_remote(job)
        st = self.node.get_step(job, step)
        own = self.node.config.node_id
        store = self.node.store
        parts = []
        lock = self._fetching.setdefault((job, -1 - step), asyncio.Lock())
        async with lock:
            st.busy += 1
            try:
                for node in sorted(st.remote_nodes - {own}):
                    dest = store.peer_dir(job, step, node)
                    if not (dest / MANIFEST).exists():
                        await self._fetch_part(job, step, node)
                    raw = await self.node.run_io((dest / MANIFEST).read_text)
                    parts.append((node, dest, raw))
            finally:
                st.busy -= 1
        return parts

    async def _fetch_part(self, job: str, step: int, node: str) -> None:
        assert self.remote is not None
        adopted = self.node.get_step(job, step).adopted
        _, raw, manifest = await fetch.node_manifest(
            self.remote, job, step, {node}, None, node, adopted
        )
        store = self.node.store
        tmp = await self.node.run_io(store.new_cache_dir, job, step)
        try:
            await fetch.download_step(self.remote, job, step, node, raw, manifest, tmp)
            await self.node.run_io(store.install_peer, tmp, job, step, node)
        except BaseException:
            await self.node.run_io(store.discard, tmp)
            raise
        log.info("%s/%d: fetched node %s's part from %s", job, step, node, self.remote.url)

    async def _restore_lease(self, job: str, size: int) -> Lease | None:
        """A segment to download into: a free one, else a new one if the budget has room
        for it and for a save of the same size after it (the client may keep it)."""
        staging = self.node.staging
        lease = staging.take_free(job, round_up(size))
        if lease is None and staging.allocated_bytes + 2 * round_up(size) <= staging.budget_bytes:
            try:
                lease = await staging.acquire(job, round_up(size), restore=True)
            except ResourceExhausted:
                return None
        return lease

    async def restore(
        self, job: str, step: int | None, rank: int, shared_memory: bool
    ) -> RestorePlan:
        """Pick a step and, if asked and a segment is free, read it into shared memory."""
        await self.refresh_remote(job)
        while True:
            st = self.choose(job, step, rank)
            st.read_at = time.monotonic()  # the evictor leaves it alone while it is served
            if st.manifest is None:
                lease = await self.fetch_to_local(st, rank, shared_memory)
                assert st.manifest is not None
                if lease is not None:  # the whole verified file is in the lease already
                    directory = self.node.store.step_dir(job, st.step)
                    return RestorePlan(st, st.manifest, directory, lease, 0)
            assert st.manifest is not None
            directory = self.node.store.step_dir(job, st.step)
            prefetched = self._prefetched.pop((job, st.step, rank), None)
            if prefetched is not None and self.node.staging.holds(prefetched):
                return RestorePlan(st, st.manifest, directory, prefetched, 0)
            if not shared_memory:
                return RestorePlan(st, st.manifest, directory, None, 0)
            record = next(r for r in st.manifest.ranks if r.rank == rank)
            path = directory / record.file
            try:
                offset = await self.node.run_io(localstore.data_offset, path)
                lease = self.node.staging.take_free(job, round_up(record.size - offset))
            except (OSError, ValueError) as exc:
                await self._set_aside(st, [f"{record.file}: {exc}"], explicit=step is not None)
                continue
            if lease is None:
                return RestorePlan(st, st.manifest, directory, None, 0)
            shards = [s for s in st.manifest.shards if s.rank == rank]
            try:
                bad = await self.node.run_io(
                    _read_and_verify, path, offset, record.size - offset, lease, shards
                )
            except BaseException:
                self.node.staging.release(lease.lease_id)
                raise
            if not bad:
                return RestorePlan(st, st.manifest, directory, lease, offset)
            self.node.staging.release(lease.lease_id)
            await self._set_aside(st, bad, explicit=step is not None)

    def lend(self, lease_id: str) -> None:
        """The client mapped a restore lease and locked it; it comes back when unlocked."""
        self.node.staging.lend(lease_id)

    async def report_corrupt(self, job: str, step: int, detail: str) -> None:
        """Re-verify a copy a client found corrupt; if bad, set it aside."""
        st = self.node.get_step(job, step)
        if st.manifest is None:
            raise FailedPrecondition(f"step {step} of job {job!r} has no local copy")
        bad = await self.node.run_io(verify_step, self.node.store.step_dir(job, step), st.manifest)
        if not bad:
            raise FailedPrecondition(
                f"step {step} of job {job!r} re-read with matching checksums; the client's "
                f"mismatch ({detail[:200]}) was not reproduced"
            )
        await self._set_aside(st, bad, explicit=False)

    async def _set_aside(self, st: StepState, bad: list[str], explicit: bool) -> None:
        node = self.node
        log.error(
            "local copy of %s/%d is corrupt (%s); setting it aside in .corrupt",
            st.job,
            st.step,
            "; ".join(bad[:5]),
        )
        quarantine = node.store.corrupt_root
        await node.run_io(
            shutil.move,
            str(node.store.step_dir(st.job, st.step)),
            str(quarantine / f"{st.job}.{st.step}.{time.time_ns()}"),
        )
        if st.in_remote:
            st.manifest = None  # the bucket's copy is fetched and served instead
            return
        node.steps.pop((st.job, st.step), None)
        if explicit:
            raise DataLoss(
                f"the local copy of step {st.step} of job {st.job!r} failed its checksum "
                f"({bad[0]}) and was set aside; no other copy exists on this node. "
                "restore() without a step picks the newest intact one"
            )


def _read_and_verify(
    path: Path, offset: int, length: int, lease: Lease, shards: list[ShardRecord]
) -> list[str]:
    view = lease.segment.view(0, round_up(length))
    try:
        localstore.read_data_direct(path, offset, length, view)
    except ValueError as exc:
        return [str(exc)]
    crcs = localstore.crc32c_ranges(view, [(s.offset - offset, s.length) for s in shards])
    return [f"{s.file}:{s.key}" for s, c in zip(shards, crcs, strict=True) if c != s.crc32c]


def verify_step(directory: Path, manifest: Manifest) -> list[str]:
    """Re-read every shard and compare crc32c; returns the mismatches (empty if intact)."""
    bad = []
    if manifest.adopted:  # files of a tree: each whole file's crc32c
        for r in manifest.ranks:
            try:
                got = localstore.crc32c_file(directory / r.file)
            except OSError as exc:
                bad.append(f"{r.file}: {exc}")
                continue
            if got != r.crc32c:
                bad.append(r.file)
        return bad
    by_file: dict[str, list[ShardRecord]] = {}
    for s in manifest.shards:
        by_file.setdefault(s.file, []).append(s)
    for fname, shards in by_file.items():
        try:
            with (
                open(directory / fname, "rb") as f,
                mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm,
            ):
                view = memoryview(mm)
                crcs = localstore.crc32c_ranges(view, [(s.offset, s.length) for s in shards])
                view.release()
        except (OSError, ValueError) as exc:
            bad.append(f"{fname}: {exc}")
            continue
        bad += [f"{fname}:{s.key}" for s, c in zip(shards, crcs, strict=True) if c != s.crc32c]
    return bad
