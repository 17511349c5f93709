"""The Peer service: what other daemons of the job may ask of this one, on TCP.

Every call must carry the shared token (link.py); anything else is refused with
UNAUTHENTICATED before a byte of the request is used. A replica is taken only from
the node its manifest names (identity.py: its certificate or its address), refused
with PERMISSION_DENIED otherwise. A replica is written only
under ``<root>/.replicas`` (replicas.py checks every name and size first), and a
file is served only if it is one a replica held here lists.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from ckptd.core.errors import CkptdError, InvalidArgument, Unavailable
from ckptd.core.manifest import ManifestInvalid
from ckptd.core.names import check_name, check_step
from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import ckptd_pb2_grpc as pb_grpc

from .. import faults
from .identity import SenderCheck, claimed_node, grpc_sender
from .link import CHUNK, authorized, owner_message, owner_of_message
from .replicas import Held, ReplicaStore

log = logging.getLogger("ckptd.peer")
T = TypeVar("T")
Run = Callable[..., Awaitable[Any]]


class PeerServicer(pb_grpc.PeerServicer):
    """Serves replicas to, and takes them from, the daemons holding the token."""

    def __init__(
        self,
        node: str,
        token: str,
        store: ReplicaStore,
        run: Run,
        on_replica: Callable[[Held], None] = lambda h: None,
        sender_check: SenderCheck | None = None,
        idle: float = 300.0,
        data_port: Callable[[], int] = lambda: 0,
    ) -> None:
        self.node, self._token, self.store, self._run = node, token, store, run
        self.sender_check = sender_check
        """Who may send which node's replicas (None: this servicer takes none)."""
        self.idle = idle
        """Seconds a PutReplica stream may stay silent (``peer_idle_seconds``)."""
        self._on_replica = on_replica
        self.received_bytes = 0
        """Bytes of replicas taken (metrics)."""
        self.served_bytes = 0
        """Bytes of replica files served to nodes restoring with GetReplicaFile (metrics)."""
        self._data_port = data_port
        """The bulk data listener's port once it listens, told in ``Hello`` (0: none)."""

    async def _check(self, context: Any) -> None:
        if not authorized(context, self._token):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "peer call without the shared token: give every daemon the same peer_token_file",
            )

    async def Hello(self, request: pb.PeerHelloRequest, context: Any) -> pb.PeerHelloResponse:
        await self._check(context)
        return pb.PeerHelloResponse(node=self.node, data_port=self._data_port())

    async def ListReplicas(
        self, request: pb.ListReplicasRequest, context: Any
    ) -> pb.ListReplicasResponse:
        await self._check(context)
        return pb.ListReplicasResponse(
            node=self.node,
            replicas=[
                pb.Replica(
                    job=h.job,
                    source_node=h.source,
                    step=h.step,
                    manifest_json=h.raw,
                    size_bytes=h.size,
                    owner=owner_message(h.owner),
                )
                for h in self.store.list(request.job, request.source_node)
            ],
        )

    async def PutReplica(
        self, request_iterator: AsyncIterator[pb.ReplicaChunk], context: Any
    ) -> pb.PutReplicaResponse:
        await self._check(context)
        incoming = None
        try:
            first = await self._next(request_iterator)
            if first is None or not first.manifest_json:
                raise InvalidArgument("a PutReplica starts with the replica's manifest")
            if self.sender_check is None:
                raise InvalidArgument("this peer takes no replicas")
            await self.sender_check.check(claimed_node(first.manifest_json), grpc_sender(context))
            holder_for = holder_for_of(context)
            begun = await self._run(
                self.store.begin,
                first.job,
                first.step,
                first.manifest_json,
                holder_for,
                owner_of_message(first),
            )
            if isinstance(begun, Held):  # its source restarted and sent it again
                return pb.PutReplicaResponse(size_bytes=begun.size)
            incoming = begun
            if first.data:
                await self._run(incoming.write, first.data)
            while (chunk := await self._next(request_iterator)) is not None:
                await self._run(incoming.write, chunk.data)
            held = await self._run(incoming.finish)
        except BaseException as exc:
            if incoming is not None:
                await self._run(incoming.abort)
            await _abort(context, exc)
            raise
        self.received_bytes += held.size
        log.info(
            "replica of %s/%d from %s held (%d bytes)", held.job, held.step, held.source, held.size
        )
        self._on_replica(held)
        return pb.PutReplicaResponse(size_bytes=held.size)

    async def _next(self, chunks: AsyncIterator[pb.ReplicaChunk]) -> pb.ReplicaChunk | None:
        """The stream's next chunk (None: its end). A sender silent for ``idle``
        seconds is dropped: its replica's budget reservation must not be held for
        ever by a stream that claimed a size and stopped."""
        try:
            return await asyncio.wait_for(anext(chunks, None), self.idle)
        except TimeoutError:
            raise Unavailable(
                f"no replica bytes for {self.idle:g} s (peer_idle_seconds): dropped"
            ) from None

    async def GetReplicaFile(
        self, request: pb.GetReplicaFileRequest, context: Any
    ) -> AsyncIterator[pb.ReplicaChunk]:
        await self._check(context)
        try:
            job = check_name("job", request.job)
            source = check_name("node", request.source_node)
            path = self.store.path(job, source, check_step(request.step), request.file)
            fd = await self._run(os.open, path, os.O_RDONLY | os.O_NOFOLLOW)
        except BaseException as exc:
            await _abort(context, exc)
            raise
        try:
            offset = request.offset
            while True:
                data = await self._run(os.pread, fd, CHUNK, offset)
                if not data:
                    return
                offset += len(data)
                self.served_bytes += len(data)
                yield pb.ReplicaChunk(data=data)
                if faults.armed("peer.serve_chunk"):  # tests: a peer dying mid-transfer
                    await asyncio.to_thread(faults.hit, "peer.serve_chunk")
        finally:
            os.close(fd)


async def _abort(context: Any, exc: BaseException) -> None:
    """Answer a refused or failed call with its status and reason (never a traceback)."""
    if isinstance(exc, ManifestInvalid):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"replica refused: {exc}")
    if isinstance(exc, CkptdError):
        await context.abort(exc.status, str(exc))
    if isinstance(exc, OSError):
        log.error("replica I/O failed: %s", exc)
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"this peer cannot do that now: {exc}")


HOLDER_FOR = "ckptd-holder-for"
"""PutReplica metadata: the newer step a replica is sent ahead of, as a step that one
references (replicas.py); absent for a source's newest step."""


def holder_for_of(context: Any) -> int:
    """The ``HOLDER_FOR`` a PutReplica call carries (0: none)."""
    for key, value in context.invocation_metadata() or ():
        if key == HOLDER_FOR:
            try:
                return int(value)
            except ValueError:
                raise InvalidArgument(f"{HOLDER_FOR} must be a step number") from None
    return 0
