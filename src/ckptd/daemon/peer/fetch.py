"""Restores from the peer tier: a node that lost its disk takes its newest step back
from the peers holding a replica of it, before the bucket.

Asked when a job has no local copy of the step a restore or listing wants (and
at start-up for every job a peer holds a replica of: the pre-staging). The
replicas of this node are listed on every peer at once; the newest step wins
unless the bucket holds a newer one. Its rank files come in parallel, each from
a holder in turn (a peer that dies mid-transfer: the file starts again from the
next holder), as :data:`RANGE_BYTES` ranges over :data:`STREAMS` connections
to the holder's bulk listener (bulk.py; ``GetReplicaFile`` from a daemon without
one), checked against the crc32c in the manifest, and the step is
committed to the local tier like a download from the bucket (manifest last, one
rename): the restore then reads it as a local copy. When no peer can give it,
the caller goes on to the bucket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Protocol

import google_crc32c

from ckptd.core import checksum
from ckptd.core.errors import DataLoss, NotFound, Unavailable
from ckptd.core.manifest import Manifest, ManifestInvalid, RankRecord
from ckptd.proto import ckptd_pb2 as pb

from ..catalog import Catalog, Step
from ..commit import RenameCommit
from ..io import IoPool
from ..local.lease import Lease, Segment
from ..local.store import LocalStore
from .bulk_client import read_range
from .link import Peer, Peers

log = logging.getLogger("ckptd.peer")

LIST_TIMEOUT_SECONDS = 5.0
FILE_TIMEOUT_SECONDS = 3600.0
ASK_AGAIN_SECONDS = 30.0
"""A job none of whose steps is local asks the peers at most this often."""
STREAMS = 4
"""Connections reading replica bytes at once (the files of a step share them)."""
RANGE_BYTES = 64 * 2**20
"""Bytes per ranged read: a big file is read over several connections at once."""
BUFFER_BYTES = 4 * 2**20


def _check(record: RankRecord, crc: int, size: int) -> None:
    """DataLoss unless the bytes that came are the manifest's."""
    if size != record.size or crc != record.crc32c:
        raise DataLoss(
            f"{record.file} came as {size} bytes with crc32c {crc:08x}, not "
            f"{record.size} with {record.crc32c:08x}"
        )


class PrestageMemory(Protocol):
    """Shared memory for pre-staged files (the restore fetcher's restore leases)."""

    async def prestage_lease(self, job: str, size: int) -> Lease | None: ...
    def keep_prefetched(self, job: str, step: int, rank: int, lease: Lease) -> None: ...
    def release(self, lease: Lease) -> None: ...


class _Placer:
    """Writes a file's bytes at their offset (from any stream thread)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __call__(self, piece: memoryview, at: int) -> None:
        done = 0
        while done < len(piece):
            done += os.pwrite(self.fd, piece[done:], at + done)


STAGE_CHUNK = 8 * 2**20


def _stage_file(path: Path, segment: Segment, record: RankRecord) -> None:
    """The whole file into ``segment`` (its pages allocated chunk by chunk), checked
    against the manifest's crc32c."""
    view = segment.view(0, record.size)
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < record.size:
            n = min(STAGE_CHUNK, record.size - pos)
            segment.populate(pos, n)
            got = f.readinto(view[pos : pos + n])
            if not got:
                raise DataLoss(f"{record.file} ends at byte {pos}, not {record.size}")
            pos += got
    segment.populate()  # the pages past the end too: a segment goes back to the pool whole
    if checksum.value(view) != record.crc32c:
        raise DataLoss(f"{record.file} does not match its crc32c")


class PeerFetcher:
    """Brings this node's steps back from its peers' replicas."""

    def __init__(self, catalog: Catalog, store: LocalStore, io: IoPool, peers: Peers) -> None:
        self.catalog, self.store, self.io, self.peers = catalog, store, io, peers
        self._locks: dict[str, asyncio.Lock] = {}
        self._asked: dict[str, float] = {}
        self.fetched_bytes = 0
        """Bytes taken from peers (metrics)."""
        self.last_seconds = 0.0
        """How long the last fetch from peers took (status)."""
        self.staged_bytes = 0
        """Bytes of pre-staged files kept in shared memory for restores (status)."""
        self._staging: set[asyncio.Future[None]] = set()
        self.memory: PrestageMemory | None = None
        """Where pre-staged files also go into shared memory (the restore fetcher,
        set by the composition root); None: the local disk only."""
        # Blocking socket reads: their own threads, never the I/O pool's, which
        # saves need while a restore is under way.
        self._streams = concurrent.futures.ThreadPoolExecutor(STREAMS, "ckptd-peer-get")
        self._fell_back_from: set[str] = set()  # peers whose bulk failure was logged
        self._buffers = threading.local()

    def close(self) -> None:
        """Stop the stream threads (a transfer under way ends with its connection)."""
        self._streams.shutdown(wait=False, cancel_futures=True)

    async def replicas(
        self, job: str = "", source: str | None = None
    ) -> dict[tuple[str, int], list[tuple[Peer, str]]]:
        """Every peer's replicas of this node (``source``: of that node; "": of any
        node) of ``job`` (empty: every job): ``(job, step) -> [(holder, manifest json)]``."""
        source = self.catalog.node_id if source is None else source

        async def ask(peer: Peer) -> list[tuple[Peer, pb.Replica]]:
            try:
                resp = await self.peers.stub(peer.address).ListReplicas(
                    pb.ListReplicasRequest(job=job, source_node=source),
                    metadata=self.peers.metadata,
                    timeout=LIST_TIMEOUT_SECONDS,
                )
            except Exception as exc:  # a dead peer is one fewer holder
                self.peers.fail(f"{peer.node} ({peer.address})", exc)
                return []
            return [(peer, r) for r in resp.replicas]

        found: dict[tuple[str, int], list[tuple[Peer, str]]] = {}
        answers = await asyncio.gather(*(ask(p) for p in await self.peers.known(fresh=True)))
        for peer, r in (pair for answer in answers for pair in answer):
            found.setdefault((r.job, r.step), []).append((peer, r.manifest_json))
        return found

    async def ensure(self, job: str, step: int | None = None, again: bool = False) -> bool:
        """Make ``step`` (or the newest step a peer holds) of ``job`` local from a peer,
        when the local tier has no copy of it and the bucket holds nothing newer;
        whether it did. A failure is logged (the caller goes on to the bucket).
        ``again``: ask the peers even if they were asked about the job lately."""
        # Under the job's lock: a restore that comes while the start-up pre-staging
        # fetches the job waits for it, then finds the copy local.
        async with self._locks.setdefault(job, asyncio.Lock()):
            local = [s for s in self.catalog.list(job) if s.local]
            if step is None and local:
                return False
            if step is not None and any(s.step == step for s in local):
                return False
            since = time.monotonic() - self._asked.get(job, -1e18)
            if step is None and since < ASK_AGAIN_SECONDS and not again:
                return False  # a job with nothing anywhere (a first start) asks now and then
            self._asked[job] = time.monotonic()
            try:
                return await self._ensure(job, step)
            except Exception as exc:
                log.warning("%s: no restore from peers (%s); the bucket is next", job, exc)
                return False

    async def _ensure(self, job: str, step: int | None) -> bool:
        held = {k: v for k, v in (await self.replicas(job)).items() if k[0] == job}
        steps = sorted((s for _, s in held), reverse=True)
        if step is not None:
            steps = [s for s in steps if s == step]
        if not steps:
            return False
        newest = steps[0]
        known = self.catalog.get(job, newest)
        if known is not None and known.local:
            return False  # fetched meanwhile (the bucket, another restore)
        timeline = int(json.loads(held[(job, newest)][0][1]).get("timeline", 0))
        in_bucket = [s.order for s in self.catalog.list(job) if s.in_remote and not s.abandoned]
        if step is None and in_bucket and max(in_bucket) > (True, timeline, newest):
            return False  # the bucket's step is a newer save: the restore takes that one
        if not in_bucket or max(in_bucket) < (True, timeline, newest):
            # Nothing here can check this step was ever committed by this node: its
            # holders took it only from this node's authenticated daemon (identity.py),
            # which is what vouches for it. Said, so a surprise has a trail.
            log.warning(
                "%s/%d: the replica held by %s is newer than the bucket's newest (%s); "
                "taken on the word of its holders, who take a node's replicas only from "
                "that node (peer_identity)",
                job, newest, ",".join(p.node for p, _ in held[(job, newest)]),
                max(in_bucket)[2] if in_bucket else "none",
            )  # fmt: skip
        await self.fetch(job, newest, held[(job, newest)])
        return True

    async def ensure_part(self, st: Step, rank: int) -> bool:
        """Make the part of ``st`` (a step the bucket holds, not this node) that holds
        ``rank`` local from a peer's replica, as the bucket would give it; whether it
        did. A replacement node under a new name has no replicas of its own: the part
        it restores is its predecessor's, which a peer may hold. A failure is logged
        (the caller goes on to the bucket)."""
        async with self._locks.setdefault(st.job, asyncio.Lock()):
            if st.local:
                return True  # fetched meanwhile
            key = f"{st.job}/{st.step}/{rank}"
            if time.monotonic() - self._asked.get(key, -1e18) < ASK_AGAIN_SECONDS:
                return False
            self._asked[key] = time.monotonic()
            try:
                holders = await self._holding(st, rank)
                if not holders:
                    return False
                await self.fetch(st.job, st.step, holders, rank)
                return True
            except Exception as exc:
                log.warning("%s/%d: no restore from peers (%s); the bucket is next",
                            st.job, st.step, exc)  # fmt: skip
                return False

    async def _holding(self, st: Step, rank: int) -> list[tuple[Peer, str]]:
        """The peers holding a replica of ``st`` whose part holds ``rank`` (the
        replicas of the part most of them hold). Only a part of a node the bucket's
        markers name for the step counts: any node of the job may hold replicas of
        its own, and one claiming ranks of a step it has no part of in the bucket
        would otherwise be taken for the missing node's."""
        found: dict[str, list[tuple[Peer, str]]] = {}
        for holder, raw in (await self.replicas(st.job, source="")).get(st.key, []):
            try:
                manifest = Manifest.from_json(raw)
            except (ManifestInvalid, ValueError):  # a bad replica is no holder
                continue
            if manifest.node not in st.remote_nodes:
                log.warning("%s/%d: %s's replica held by %s is no part the bucket names; "
                            "not taken", st.job, st.step, manifest.node, holder.node)  # fmt: skip
                continue
            if not manifest.adopted and any(r.rank == rank for r in manifest.ranks):
                found.setdefault(raw, []).append((holder, raw))
        return max(found.values(), key=len, default=[])

    async def fetch(
        self, job: str, step: int, holders: list[tuple[Peer, str]], rank: int | None = None
    ) -> None:
        """Download this node's part of ``step`` (``rank``: the part holding it, any
        node's) from ``holders``, check it, commit it."""
        t0 = time.monotonic()
        raw = holders[0][1]
        manifest = Manifest.from_json(raw)
        me = self.catalog.node_id
        mine = manifest.node == me if rank is None else any(r.rank == rank for r in manifest.ranks)
        if (manifest.job, manifest.step) != (job, step) or not mine or manifest.adopted:
            raise DataLoss(f"a peer's replica of {job}/{step} is not the part asked for")
        peers = [p for p, text in holders if text == raw]
        commit = await self.io.run(self.store.begin_step, job, step, self.io.run, True)
        try:
            # Each file from its own first holder (files spread over the holders).
            givers = await asyncio.gather(
                *(
                    self._file(commit, manifest, record, peers[i % n :] + peers[: i % n])
                    for i, record in enumerate(manifest.ranks)
                    for n in (len(peers),)
                )
            )
            await commit.finalize(raw.encode())
        except BaseException:
            await commit.abort()
            raise
        self.last_seconds = time.monotonic() - t0
        gave = ",".join(sorted(set(givers)))
        st = self.catalog.peer_fetched(manifest, gave)
        log.info(
            "%s/%d taken from peers %s in %.2f s (%d bytes) and committed locally",
            job, step, gave, self.last_seconds, manifest.size_bytes,
        )  # fmt: skip
        if self.memory is not None:
            task = asyncio.ensure_future(self._stage(st, manifest))
            self._staging.add(task)
            task.add_done_callback(self._staging.discard)

    async def _stage(self, st: Step, manifest: Manifest) -> None:
        """Copy the committed files into shared memory, each kept for its rank's
        restore (which then hands the segment over instead of reading the disk).
        After the commit, off the fetch's path: a restore that comes first reads the
        local copy (fresh shared memory is slow on these VMs: ~0.4 s per GiB on the
        fetch when it was filled as the bytes came). A file that does not fit in the
        staging budget, or fails, stays on disk only; once a restore has read the
        step (the trainer came first) the staging stops: a segment nobody claims
        would hold its memory until the lease timeout."""
        assert self.memory is not None
        directory = self.store.step_dir(st.job, st.step)
        fetched_at = st.read_at  # a restore serving the step sets it anew
        with self.catalog.in_use(st):  # the evictor leaves the files alone meanwhile
            for record in manifest.ranks:
                if st.read_at != fetched_at:
                    return
                lease = await self.memory.prestage_lease(st.job, record.size)
                if lease is None:
                    return
                try:
                    await self.io.run(_stage_file, directory / record.file, lease.segment, record)
                except Exception as exc:
                    self.memory.release(lease)
                    log.warning("%s/%d: %s not staged in shared memory (%s)",
                                st.job, st.step, record.file, exc)  # fmt: skip
                    return
                if st.read_at != fetched_at:
                    self.memory.release(lease)
                    return
                self.memory.keep_prefetched(st.job, st.step, record.rank, lease)
                self.staged_bytes += record.size

    async def _file(
        self, commit: RenameCommit, manifest: Manifest, record: RankRecord, order: list[Peer]
    ) -> str:
        """One rank file from the first holder in ``order`` that gives all of it (its
        node name)."""
        path = commit.path / record.file
        reasons = []
        for peer in order:
            try:
                await self._download(peer, manifest, record, str(path))
                return peer.node
            except Exception as exc:  # dead mid-transfer, refused, corrupt: the next one
                reasons.append(f"{peer.node}: {exc}")
                self.peers.fail(f"{peer.node} ({peer.address})", exc)
        raise NotFound(f"no peer gave {record.file} whole: {'; '.join(reasons)}")

    async def _download(
        self, peer: Peer, manifest: Manifest, record: RankRecord, path: str
    ) -> None:
        fd = await self.io.run(
            os.open, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o640
        )
        try:
            place = _Placer(fd)
            if peer.data_port:
                try:
                    _check(record, *await self._ranges(peer, manifest, record, place))
                except (DataLoss, Unavailable) as exc:
                    # Refused, cut, timed out or corrupt on the bulk listener: the same
                    # peer's gRPC service may still give it (its own port, flow control).
                    self._fell_back(peer, exc)
                    _check(record, *await self._stream(peer, manifest, record, place))
            else:
                _check(record, *await self._stream(peer, manifest, record, place))
            await self.io.run(os.fsync, fd)
        finally:
            os.close(fd)

    def _fell_back(self, peer: Peer, exc: Exception) -> None:
        """Log, once per peer, a bulk read that failed over to gRPC."""
        if peer.node not in self._fell_back_from:
            self._fell_back_from.add(peer.node)
            log.warning("peer %s: replica data port failed (%s); reading through its "
                        "Peer service instead", peer.node, exc)  # fmt: skip

    async def _ranges(
        self, peer: Peer, manifest: Manifest, record: RankRecord, place: _Placer
    ) -> tuple[int, int]:
        """The file from ``peer``'s bulk listener, its ranges in parallel; (crc32c,
        size)."""
        request = {
            "job": manifest.job,
            "source": manifest.node,
            "step": manifest.step,
            "file": record.file,
        }
        spans = [(o, min(RANGE_BYTES, record.size - o)) for o in range(0, record.size, RANGE_BYTES)]
        loop = asyncio.get_running_loop()
        done = await asyncio.gather(
            *(
                loop.run_in_executor(self._streams, self._range, peer, request, place, o, n)
                for o, n in spans
            ),
            return_exceptions=True,  # every thread done with fd before it is closed
        )
        crcs = [r for r in done if not isinstance(r, BaseException)]
        if len(crcs) < len(done):
            raise next(r for r in done if isinstance(r, BaseException))
        self.fetched_bytes += record.size
        crc = checksum.combine_all([(c, n) for c, (_, n) in zip(crcs, spans, strict=True)])
        return crc, record.size

    def _range(
        self, peer: Peer, request: dict[str, object], place: _Placer, offset: int, length: int
    ) -> int:
        """One range, written at its place (a stream thread); its crc32c."""
        buf = getattr(self._buffers, "buf", None)
        if buf is None:
            buf = self._buffers.buf = memoryview(bytearray(BUFFER_BYTES))
        at = offset

        def sink(piece: memoryview) -> None:
            nonlocal at
            place(piece, at)
            at += len(piece)

        req = {**request, "offset": offset, "length": length}
        tls, name = self.peers.tls, peer.host
        return read_range(peer.data_address, self.peers.token, req, buf, sink, tls, name)

    async def _stream(
        self, peer: Peer, manifest: Manifest, record: RankRecord, place: _Placer
    ) -> tuple[int, int]:
        """The file from ``peer``'s ``GetReplicaFile`` (a daemon without a bulk
        listener); (crc32c, size)."""
        crc, size = 0, 0
        call = self.peers.stub(peer.address).GetReplicaFile(
            pb.GetReplicaFileRequest(
                job=manifest.job,
                source_node=manifest.node,
                step=manifest.step,
                file=record.file,
            ),
            metadata=self.peers.metadata,
            timeout=FILE_TIMEOUT_SECONDS,
        )
        async for chunk in call:
            if size + len(chunk.data) > record.size:
                raise DataLoss(f"{record.file} is longer than its {record.size} bytes")
            await self.io.run(place, memoryview(chunk.data), size)
            crc = google_crc32c.extend(crc, chunk.data)
            size += len(chunk.data)
            self.fetched_bytes += len(chunk.data)
        return crc, size
