"""Sends each job's newest LOCAL step to ``peer_replicas`` peers (the peer tier).

Woken by every step reaching LOCAL; a step superseded while an older one was
being sent is skipped (only the newest matters: a peer keeps one replica per job
and node). It pauses while a save is being written on this node (STAGING), so it
does not compete with a save for the disk and the cores, but for at most
``peer_max_lag_seconds`` from the moment the job's replica fell behind its newest
local step: a continuous save loop never leaves a gap, and the replica must not
starve (it is the node-loss copy). An incremental step (core/increments.py) sends
only its own rank files, the new bytes: the older steps it references go first,
those the peer does not hold already. The rank files are read
back from the local tier while the catalog holds the step in use (the evictor
leaves it alone), at most ``peer_bandwidth_bytes`` per second, and pushed to the
peer's bulk listener (bulk.py: a plain socket, a fraction of gRPC's CPU), or with
``PutReplica`` to a peer without one. A peer that
refuses or fails is logged and the next in the ring is tried; the step's
``replica_nodes`` (``ckptd ls``: tier ``peer``) says who holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import time
from collections.abc import AsyncIterator, Callable

from ckptd.core.errors import DataLoss, NotFound, Unavailable
from ckptd.core.manifest import Manifest
from ckptd.proto import ckptd_pb2 as pb

from ..catalog import Event, Step
from ..catalog.roles import Copies
from ..files import open_direct
from ..io import IoPool
from ..local.store import LocalStore
from .bulk_client import push
from .link import CHUNK, Limiter, Peer, Peers, owner_message
from .service import HOLDER_FOR

log = logging.getLogger("ckptd.peer")

SEND_TIMEOUT_SECONDS = 3600.0
LIST_TIMEOUT_SECONDS = 30.0
RETRY_SECONDS = 5.0


class Replicator:
    """The background service that keeps each job's newest local step on peers."""

    def __init__(
        self,
        catalog: Copies,
        store: LocalStore,
        io: IoPool,
        peers: Peers,
        replicas: int,
        limiter: Limiter,
        max_lag: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        owner_of: Callable[[str], int | None] = lambda job: None,
    ) -> None:
        self.catalog, self.store, self.io, self.peers = catalog, store, io, peers
        self.replicas = replicas
        self.limiter = limiter
        self.max_lag = max_lag
        self._clock = clock
        self.owner_of = owner_of
        """Each job's owner here (api/access.py), sent with its replicas: a node that
        lost its disk takes its jobs back from its peers with their owners."""
        self._behind: dict[str, float] = {}
        """Per job, since when its newest local step has had no replica (cleared once
        the replica caught up): replication stops yielding to saves at ``max_lag``."""
        self._dirty: set[str] = set()
        self._retry: set[str] = set()
        self._stopping = False
        self._task: asyncio.Future[bool] | None = None
        self._wake = asyncio.Event()
        self._sent: dict[str, tuple[int, int]] = {}
        self.sent_bytes = 0
        """Bytes of replicas sent (metrics)."""
        self.last_error = ""
        self._fell_back_from: set[str] = set()
        self.saves_idle = asyncio.Event()
        """Set while no save is being written on this node (replication waits)."""
        self.saves_idle.set()
        catalog.subscribe(self._on_event)

    def stop(self) -> None:
        """Return from :meth:`run` (after the replica being sent, if any)."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()  # a peer may take long to answer

    def _on_event(self, event: Event) -> None:
        # Replication yields to saves: it measured +14-22% on a continuous loop's
        # step time while it ran beside the saves' writes, +3% paused during them.
        if self.catalog.count(pb.SAVE_STATE_STAGING):
            self.saves_idle.clear()
        else:
            self.saves_idle.set()
        if event.kind in (pb.STEP_EVENT_LOCAL, pb.STEP_EVENT_RECOVERED):
            self._behind.setdefault(event.job, self._clock())
            self._dirty.add(event.job)
            self._wake.set()

    async def yield_to_saves(self, job: str) -> None:
        """Wait while a save is being written on this node, unless ``job``'s replica
        has been behind for ``max_lag`` seconds already (then send regardless)."""
        if self.saves_idle.is_set():
            return
        left = self._behind.get(job, self._clock()) + self.max_lag - self._clock()
        if left > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.saves_idle.wait(), left)

    async def run(self) -> None:
        """Replicate until cancelled; a job no peer took is tried again every
        :data:`RETRY_SECONDS` (its peers may still be starting, or be replaced)."""
        while not self._stopping:
            if self._retry:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), RETRY_SECONDS)
                self._dirty |= self._retry
                self._retry.clear()
            else:
                await self._wake.wait()
            self._wake.clear()
            while self._dirty and not self._stopping:
                job = self._dirty.pop()
                self._task = asyncio.ensure_future(self.replicate(job))
                try:
                    took = await self._task
                except asyncio.CancelledError:
                    if self._stopping:
                        return  # stop() cut the send short
                    raise
                except Exception as exc:  # a bug here must not drop the job for good
                    log.exception("replicating %s failed", job)
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    took = False
                if not took:
                    self._retry.add(job)

    def newest(self, job: str) -> Step | None:
        """The newest step of ``job`` with a local copy of ckptd rank files."""
        return next((s for s in self.catalog.list(job) if s.local and not s.adopted), None)

    async def replicate(self, job: str) -> bool:
        """Send the job's newest local step to peers until ``peer_replicas`` hold it;
        whether they do (False: try again later)."""
        st = self.newest(job)
        if st is None or self._sent.get(job) == (st.timeline, st.step):
            self._behind.pop(job, None)
            return True  # nothing (new) to send
        holders = set(st.replica_nodes)
        for peer in await self.peers.ring():
            if len(holders) >= self.replicas:
                break
            if peer.node in holders:
                continue
            newer = self.newest(job)
            if newer is not None and newer.order > st.order:
                self._dirty.add(job)  # superseded: send the newer one instead
                return True
            self.catalog.replicating(st, frozenset({peer.node}))
            if await self._send(peer, st):
                self.catalog.replicated(st, frozenset({peer.node}))
                holders.add(peer.node)
        if len(holders) >= self.replicas:
            self._sent[job] = (st.timeline, st.step)  # a step saved again: sent again
            newest = self.newest(job)
            if newest is None or newest.step == st.step:  # caught up
                self._behind.pop(job, None)
            return True
        self.last_error = self.peers.last_error or "too few peers answered"
        log.warning(
            "%s/%d has %d of %d replicas on peers: %s",
            job, st.step, len(holders), self.replicas, self.last_error,
        )  # fmt: skip
        return False

    async def _send(self, peer: Peer, st: Step) -> bool:
        """One replica of ``st`` to ``peer`` (its bulk listener, else PutReplica), the
        steps it references first where the peer lacks them; False (logged) if it did
        not take it."""
        with self.catalog.in_use(st):  # its files stay while they are read
            manifest = st.manifest
            if manifest is None:
                return False
            try:
                if manifest.holders():
                    await self._send_holders(peer, st, manifest)
                await self._send_one(peer, st, manifest)
            except Exception as exc:  # a refusal, a dead peer, a file gone: next peer
                self.peers.fail(f"{peer.node} ({peer.address})", exc)
                return False
        log.info("%s/%d replicated to %s", st.job, st.step, peer.node)
        return True

    async def _send_one(
        self, peer: Peer, st: Step, manifest: Manifest, holder_for: int = 0
    ) -> None:
        """``st``'s files to ``peer`` (``holder_for``: sent ahead of that newer step,
        which references it)."""
        if not peer.data_port or not await self._push(peer, st, manifest, holder_for):
            extra = ((HOLDER_FOR, str(holder_for)),) if holder_for else ()
            await self.peers.stub(peer.address).PutReplica(
                self._chunks(st, manifest),
                metadata=(*self.peers.metadata, *extra),
                timeout=SEND_TIMEOUT_SECONDS,
            )

    async def _send_holders(self, peer: Peer, st: Step, manifest: Manifest) -> None:
        """Every step ``st`` references, transitively, that ``peer`` does not hold,
        oldest first: a peer takes an incremental replica only with them (replicas.py),
        and the new step's own files are then all it is sent of it."""
        needed = self._references(st, manifest)
        listed = await self.peers.stub(peer.address).ListReplicas(
            pb.ListReplicasRequest(job=st.job, source_node=self.catalog.node_id),
            metadata=self.peers.metadata,
            timeout=LIST_TIMEOUT_SECONDS,
        )
        held = {r.step: r.manifest_json for r in listed.replicas}
        for step in sorted(needed):
            older = needed[step]
            with self.catalog.in_use(older):
                m = older.manifest
                if m is None:
                    raise NotFound(f"{st.job}/{step}, which {st.step} references, left this node")
                if held.get(step) != m.to_json():
                    await self._send_one(peer, older, m, holder_for=st.step)

    def _references(self, st: Step, manifest: Manifest) -> dict[int, Step]:
        """The local steps ``st`` references, transitively (each tier holding a step
        holds them)."""
        found: dict[int, Step] = {}
        todo = set(manifest.holders())
        while todo:
            step = todo.pop()
            if step in found:
                continue
            older = self.catalog.get(st.job, step)
            if older is None or not older.local or older.manifest is None:
                raise NotFound(f"{st.job}/{st.step} references step {step}, not local here")
            found[step] = older
            todo |= older.manifest.holders()
        return found

    async def _push(self, peer: Peer, st: Step, manifest: Manifest, holder_for: int = 0) -> bool:
        """``st`` to ``peer``'s bulk listener; False (logged once per peer) if that
        failed for a reason its Peer service may not share (the data port refused,
        cut or timed out): the caller sends it with PutReplica instead."""
        request: dict[str, object] = {
            "job": st.job,
            "step": st.step,
            "manifest": manifest.to_json(),
            "owner": self.owner_of(st.job),
        }
        if holder_for:
            request["holder_for"] = holder_for
        try:
            await push(
                peer.data_address,
                self.peers.token,
                request,
                lambda: self._pieces(st, manifest),
                sum(r.size for r in manifest.ranks),
                self.peers.tls,
                peer.host,
            )
        except (DataLoss, Unavailable) as exc:
            if peer.node not in self._fell_back_from:
                self._fell_back_from.add(peer.node)
                log.warning("peer %s: replica data port failed (%s); sending through its "
                            "Peer service instead", peer.node, exc)  # fmt: skip
            return False
        return True

    async def _chunks(self, st: Step, manifest: Manifest) -> AsyncIterator[pb.ReplicaChunk]:
        """The PutReplica stream: the manifest, then the files' bytes."""
        yield pb.ReplicaChunk(
            job=st.job,
            step=st.step,
            manifest_json=manifest.to_json(),
            owner=owner_message((self.owner_of(st.job), True)),
        )
        async for piece in self._pieces(st, manifest):
            yield pb.ReplicaChunk(data=bytes(piece))

    async def _pieces(self, st: Step, manifest: Manifest) -> AsyncIterator[memoryview]:
        """The rank files' bytes back to back, a chunk at a time, each valid until the
        next is asked for: yielding to saves, within the bandwidth cap."""
        directory = self.store.step_dir(st.job, st.step)
        # Page-aligned, as O_DIRECT needs; freed with the generator (a call the peer
        # answered early leaves it suspended, still holding a view).
        buf = mmap.mmap(-1, CHUNK)
        for record in manifest.ranks:
            # O_DIRECT into one reused buffer: reading a step back through the page
            # cache would allocate fresh memory, slow on these VMs and taken from the
            # trainer (docs/architecture.md, "Performance notes").
            fd, _ = await self.io.run(open_direct, directory / record.file, os.O_RDONLY)
            try:
                offset = 0
                while offset < record.size:
                    await self.yield_to_saves(st.job)
                    await self.limiter.take(min(CHUNK, record.size - offset))
                    n = await self.io.run(_read_chunk, fd, buf, offset, record.size)
                    offset += n
                    self.sent_bytes += n
                    yield memoryview(buf)[:n]
            finally:
                os.close(fd)


def _read_chunk(fd: int, buf: mmap.mmap, offset: int, size: int) -> int:
    """Read the file's bytes at ``offset`` (a multiple of the chunk), at most a chunk,
    in whole blocks into ``buf`` (the kernel stops at the end of the file); how many
    of them are the file's."""
    got = os.preadv(fd, [memoryview(buf)], offset)
    want = min(CHUNK, size - offset)
    if got < want:
        raise OSError(f"a rank file ends at {offset + got} bytes, not {size}")
    return want
