"""The peers as a restore's tier: a node that lost its disk takes its steps back
from the peers holding a replica of them, before the bucket.

Asked when a job has no local copy of the step a restore or listing wants (and
at start-up for every job a peer holds a replica of: the pre-staging). The
replicas of this node are listed on every peer at once; the restore's chooser
takes the newest step unless the bucket holds a newer one. Its rank files come
in parallel from the holders (transfer.py), are checked against the crc32c in
the manifest, and the step is committed to the local tier like a download from
the bucket (manifest last, one rename): the restore then reads it as a local
copy. An incremental step comes with the older steps it references that the
local tier lacks (references.py), each fetched and committed the same way first,
oldest first, so the local tier holds them all. When no peer can give it, the
chooser goes on to the bucket.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from ckptd.core import checksum
from ckptd.core.errors import DataLoss, NotFound, Unavailable
from ckptd.core.manifest import Manifest, ManifestInvalid, RankRecord
from ckptd.core.names import Owner
from ckptd.proto import ckptd_pb2 as pb

from ..catalog import Step
from ..catalog.roles import Copies
from ..io import IoPool
from ..local.lease import Handed, Lease, Segment, Want
from ..local.store import LocalStore, retire_replaced
from .link import Peer, Peers, owner_of_message
from .references import Replica, referenced
from .transfer import ReplicaReader

log = logging.getLogger("ckptd.peer")

LIST_TIMEOUT_SECONDS = 5.0
ASK_AGAIN_SECONDS = 30.0
"""A job none of whose steps is local asks the peers at most this often."""

Holders = list[tuple[Peer, str, Owner]]
"""The peers holding one replica, each with its manifest (JSON) and the job's owner
that came with it, as they list it."""
OwnerFound = Callable[[str, int | None, bool], None]
"""Told ``(job, owner, known)``: the owner a replica of a job came with."""
Order = tuple[bool, int, int]
"""A step's place in its job's history: ``Step.order`` (catalog/step.py)."""
Learn = Callable[[str], Awaitable[None]]
"""Learns which steps of a job the bucket holds (logs, never raises, a bucket away)."""
LEARN_SECONDS = 10.0
"""How long the pre-staging waits for the bucket before it goes on the peers' word."""


async def _knows_already(job: str) -> None:
    """No bucket to learn from."""


class PrestageMemory(Protocol):
    """Shared memory for pre-staged files (local/prestaged.py)."""

    async def lease_for(self, job: str, size: int) -> Lease | None: ...
    def keep(
        self, job: str, step: int, rank: int, lease: Lease, holds: tuple[int, int]
    ) -> None: ...
    def release(self, lease: Lease) -> None: ...


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


class PeerSource:
    """Brings this node's steps back from its peers' replicas."""

    name = "peer"

    def __init__(
        self,
        catalog: Copies,
        store: LocalStore,
        io: IoPool,
        peers: Peers,
        memory: PrestageMemory | None = None,
        owner_found: OwnerFound = lambda job, owner, known: None,
        learn: Learn = _knows_already,
    ) -> None:
        self.catalog, self.store, self.io, self.peers = catalog, store, io, peers
        self.owner_found = owner_found
        """Told the owner a replica came with before its step is taken in
        (api/access.py): a job taken back from peers is not open to the first caller."""
        self.learn = learn
        """Learns which steps of a job the bucket holds (restore/tier.py's bucket,
        quietly): the start-up pre-staging weighs the peers' replicas against them."""
        self.reader = ReplicaReader(io, peers)
        self._locks: dict[str, asyncio.Lock] = {}
        self._asked: dict[str, float] = {}
        self._own: dict[tuple[str, int], Replica] = {}
        """This node's replicas, with their holders, as the last listing of their job
        found them."""
        self.last_seconds = 0.0
        """How long the last fetch from peers took (status)."""
        self.staged_bytes = 0
        """Bytes of pre-staged files kept in shared memory for restores (status)."""
        self._staging: set[asyncio.Future[None]] = set()
        self.memory = memory
        """Where pre-staged files also go into shared memory (the memory tier);
        None: the local disk only."""

    @property
    def fetched_bytes(self) -> int:
        """Bytes taken from peers (metrics)."""
        return self.reader.fetched_bytes

    def close(self) -> None:
        """Stop the stream threads (a transfer under way ends with its connection)."""
        self.reader.close()

    async def replicas(
        self, job: str = "", source: str | None = None
    ) -> dict[tuple[str, int], Holders]:
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

        found: dict[tuple[str, int], Holders] = {}
        answers = await asyncio.gather(*(ask(p) for p in await self.peers.known(fresh=True)))
        for peer, r in (pair for answer in answers for pair in answer):
            found.setdefault((r.job, r.step), []).append(
                (peer, r.manifest_json, owner_of_message(r))
            )
        return found

    async def _listing(
        self, job: str, source: str | None = None
    ) -> dict[tuple[str, int], list[Replica]]:
        """:meth:`replicas`, each manifest parsed once: per step, its distinct
        replicas in the order the peers named them, each with every peer holding
        it. A replica whose manifest does not parse is none (logged)."""
        found: dict[tuple[str, int], list[Replica]] = {}
        bad: set[str] = set()
        for (j, n), held in (await self.replicas(job, source)).items():
            same: dict[str, Replica] = {}
            for peer, text, owner in held:
                if text in same:
                    same[text].peers.append(peer)
                elif text not in bad:
                    try:
                        same[text] = Replica(Manifest.from_json(text), text, [peer], owner)
                    except (ManifestInvalid, ValueError) as exc:
                        bad.add(text)
                        log.warning("%s/%d: the replica held by %s is not taken (%s)",
                                    j, n, peer.node, exc)  # fmt: skip
            if same:
                found[(j, n)] = list(same.values())
        return found

    async def holds(self, job: str, step: int | None) -> list[Order]:
        """This node's steps of ``job`` (only ``step``, when given) the peers hold a
        replica of, newest first. Nothing while the local tier holds the step (or,
        with none given, any step of the job): only a node that lost its disk asks
        the peers, and a job with nothing anywhere (a first start) asks at most every
        :data:`ASK_AGAIN_SECONDS` (meanwhile the last answer stands). A failure is
        logged (the bucket is next)."""
        # Under the job's lock: a restore that comes while the start-up pre-staging
        # (or another rank's restore) fetches the job waits for it, then finds the
        # copy local.
        async with self._locks.setdefault(job, asyncio.Lock()):
            return await self._holds(job, step)

    async def _holds(self, job: str, step: int | None) -> list[Order]:
        local = [s for s in self.catalog.list(job) if s.local]
        if step is None and local:
            return []
        if step is not None and any(s.step == step for s in local):
            return []
        since = time.monotonic() - self._asked.get(job, -1e18)
        if step is not None or since >= ASK_AGAIN_SECONDS:
            self._asked[job] = time.monotonic()
            try:
                listed = await self._listing(job)
            except Exception as exc:
                log.warning("%s: no restore from peers (%s); the bucket is next", job, exc)
                return []
            self._own = {k: v for k, v in self._own.items() if k[0] != job}
            for (j, n), (first, *_) in listed.items():
                if j == job:  # the first one named, as the peers answered
                    self._own[(job, n)] = first
        found = ((True, r.manifest.timeline, n) for (j, n), r in self._own.items() if j == job)
        return sorted((o for o in found if step in (None, o[2])), reverse=True)

    async def bring(self, job: str, step: int, want: Want) -> Handed | None:
        """Take ``step`` back from the peers into the local tier: this node's own part
        if they hold a replica of it, else (a replacement node under a new name) the
        part the bucket names that holds the rank wanted (:meth:`ensure_part`)."""
        async with self._locks.setdefault(job, asyncio.Lock()):
            if await self._take(job, step):
                return None
        known = self.catalog.get(job, step)
        if known is None or want.rank is None:
            raise NotFound(f"no peer gave a replica of {job}/{step} of this node")
        if not await self.ensure_part(known, want.rank):
            raise Unavailable(f"no peer gave the part of {job}/{step} holding rank {want.rank}")
        return None

    async def _take(self, job: str, step: int) -> bool:
        """This node's own part of ``step`` from the peers the last listing found
        holding it; whether the step is local now. A failure is logged, and that
        listing's answer for the step forgotten."""
        known = self.catalog.get(job, step)
        if known is not None and known.local:
            return True  # fetched meanwhile (the bucket, another restore, the pre-staging)
        if (job, step) not in self._own:
            return False
        replica = self._own[(job, step)]
        try:
            self._vouch(job, step, replica)
            await self.fetch(job, step, replica)
        except Exception as exc:
            del self._own[(job, step)]
            log.warning("%s: no restore from peers (%s); the bucket is next", job, exc)
            return False
        return True

    def _vouch(self, job: str, step: int, replica: Replica) -> None:
        """Log a replica newer than every step of the bucket: nothing here can check
        it was ever committed by this node; its holders took it only from this
        node's authenticated daemon (identity.py), which is what vouches for it.
        Said, so a surprise has a trail."""
        in_bucket = [s.order for s in self.catalog.list(job) if s.in_remote and not s.abandoned]
        if not in_bucket or max(in_bucket) < (True, replica.manifest.timeline, step):
            log.warning(
                "%s/%d: the replica held by %s is newer than the bucket's newest (%s); "
                "taken on the word of its holders, who take a node's replicas only from "
                "that node (peer_identity)",
                job, step, ",".join(p.node for p in replica.peers),
                max(in_bucket)[2] if in_bucket else "none",
            )  # fmt: skip

    async def ensure(self, job: str) -> bool:
        """Make the newest step of ``job`` the peers hold of this node local, when the
        local tier has none and the bucket holds nothing newer (the start-up
        pre-staging); whether it did. A failure is logged."""
        # After a node loss the catalog knows nothing of the bucket yet: a replica of a
        # save the bucket holds a later one under its number would otherwise be taken.
        learning = asyncio.ensure_future(self.learn(job))
        await asyncio.wait({learning}, timeout=LEARN_SECONDS)  # the bucket away: go on
        async with self._locks.setdefault(job, asyncio.Lock()):
            held = await self._holds(job, None)
            in_bucket = [s.order for s in self.catalog.list(job) if s.in_remote and not s.abandoned]
            if not held or (in_bucket and max(in_bucket) > held[0]):
                return False  # the bucket's step is a newer save: a restore takes that one
            return await self._take(job, held[0][2])

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
                replica = await self._holding(st, rank)
                if replica is None:
                    return False
                await self.fetch(st.job, st.step, replica, rank)
                return True
            except Exception as exc:
                log.warning("%s/%d: no restore from peers (%s); the bucket is next",
                            st.job, st.step, exc)  # fmt: skip
                return False

    async def _holding(self, st: Step, rank: int) -> Replica | None:
        """The replica of ``st`` whose part holds ``rank`` (of such parts, the one most
        peers hold). Only a part of a node the bucket's markers name for the step
        counts: any node of the job may hold replicas of its own, and one claiming
        ranks of a step it has no part of in the bucket would otherwise be taken for
        the missing node's."""
        found: list[Replica] = []
        for replica in (await self._listing(st.job, source="")).get(st.key, []):
            manifest = replica.manifest
            if manifest.node not in st.remote_nodes:
                log.warning("%s/%d: %s's replica held by %s is no part the bucket names; "
                            "not taken", st.job, st.step, manifest.node,
                            ",".join(p.node for p in replica.peers))  # fmt: skip
                continue
            if not manifest.adopted and any(r.rank == rank for r in manifest.ranks):
                found.append(replica)
        return max(found, key=lambda r: len(r.peers), default=None)

    async def fetch(self, job: str, step: int, replica: Replica, rank: int | None = None) -> None:
        """Download this node's part of ``step`` (``rank``: the part holding it, any
        node's) from the peers holding ``replica``, check it, commit it."""
        t0 = time.monotonic()
        manifest = replica.manifest
        me = self.catalog.node_id
        mine = manifest.node == me if rank is None else any(r.rank == rank for r in manifest.ranks)
        if (manifest.job, manifest.step) != (job, step) or not mine or manifest.adopted:
            raise DataLoss(f"a peer's replica of {job}/{step} is not the part asked for")
        known = self.catalog.get(job, step)
        if known is not None and known.timeline > manifest.timeline:  # an older save's
            raise DataLoss(
                f"the peers' replica of {job}/{step} is of timeline {manifest.timeline}, "
                f"the step known here of {known.timeline} (a later save replaced it)"
            )
        self.owner_found(job, *replica.owner)  # before any step of it can be listed
        if manifest.holders():  # the local tier holds a step with the steps it references
            await self._bring_references(manifest)
        gave = await self._commit(replica)
        self.last_seconds = time.monotonic() - t0
        st = self.catalog.peer_fetched(manifest, gave)
        log.info(
            "%s/%d taken from peers %s in %.2f s (%d bytes) and committed locally",
            job, step, gave, self.last_seconds, manifest.size_bytes,
        )  # fmt: skip
        if self.memory is not None:
            task = asyncio.ensure_future(self._stage(st, manifest))
            self._staging.add(task)
            task.add_done_callback(self._staging.discard)

    async def _commit(self, replica: Replica) -> str:
        """``replica``'s files from its holders into the local tier, each checked
        against its crc32c, then its manifest (the commit point); who gave them."""
        manifest, peers = replica.manifest, replica.peers
        commit = await self.io.run(
            self.store.begin_step, manifest.job, manifest.step, self.io.run, True
        )
        try:
            # Each file from its own first holder (files spread over the holders).
            givers = await asyncio.gather(
                *(
                    self.reader.file(commit.path, manifest, record, peers[i % n :] + peers[: i % n])
                    for i, record in enumerate(manifest.ranks)
                    for n in (len(peers),)
                )
            )
            known = self.catalog.get(manifest.job, manifest.step)
            if known is not None:  # a local copy it replaces leaves view first
                await retire_replaced(self.catalog, self.store, self.io, known)
            await commit.finalize(replica.text.encode())
        except BaseException:
            await commit.abort()
            raise
        return ",".join(sorted(set(givers)))

    async def _bring_references(self, manifest: Manifest) -> None:
        """Make every step ``manifest`` references, transitively, local (oldest first)
        from the peers' replicas of the same node, unless the local tier holds it
        already with the very files referenced. DataLoss if one cannot be had: the
        restore then goes on to the bucket."""
        job = manifest.job
        listed = await self._listing(job, source=manifest.node)
        wanted = referenced(manifest, lambda step: self.catalog.get(job, step), listed)
        for step, replica in sorted(wanted.items()):
            if replica is None or _local(self.catalog.get(job, step)):
                continue  # local already (made so meanwhile, too)
            gave = await self._commit(replica)
            self.catalog.peer_fetched(replica.manifest, gave)
            log.info("%s/%d, which %d references, taken from peers %s",
                     job, step, manifest.step, gave)  # fmt: skip

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
                if record.incremental:  # its file is not its image: the local tier assembles it
                    continue
                lease = await self.memory.lease_for(st.job, record.size)
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
                holds = (manifest.timeline, record.crc32c)
                self.memory.keep(st.job, st.step, record.rank, lease, holds)
                self.staged_bytes += record.size


def _local(st: Step | None) -> bool:
    return st is not None and st.local
