"""The peer tier: its parts (built by the composition root), started beside the daemon.

- the Peer service on ``peer_address`` (TCP), taking replicas and telling what it
  holds (service.py, replicas.py), and beside it the bulk listener serving their
  bytes to restoring nodes (bulk.py, ``peer_data_port``), when that is set;
- the replicator sending each job's newest local step to ``peer_replicas`` of
  ``peers`` (replicator.py), and the source restoring a wiped node from them
  (source.py), when ``peers`` is set; at start-up it pre-stages every job
  a peer holds a replica of and this node does not (a replacement node's root is
  empty), so the trainer's restore then reads a local copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from ckptd.core.errors import FailedPrecondition

from ..io import IoPool
from .identity import BoundBulkServer, SenderCheck
from .link import Peers
from .options import PeerOptions
from .replicas import ReplicaStore
from .replicator import Replicator
from .service import PeerServicer
from .source import PeerSource
from .tls import PeerTls

log = logging.getLogger("ckptd.peer")


class PeerTier:
    """Everything of the peer tier one daemon runs, built by the composition root
    (app/peer_parts.py); :meth:`start` binds the listeners and starts the loops."""

    def __init__(
        self,
        options: PeerOptions,
        io: IoPool,
        tls: PeerTls | None,
        store: ReplicaStore,
        peers: Peers,
        sender_check: SenderCheck,
        servicer: PeerServicer,
        bulk: BoundBulkServer,
        server: grpc.aio.Server | None,
        replicator: Replicator | None,
        source: PeerSource | None,
    ) -> None:
        self.io = io
        self.tls = tls
        self.listen = options.peer_address
        self.data_port = options.peer_data_port
        self.address = ""
        self.prestaging = False
        """Taking this node's steps back from the peers (:meth:`prestage`)."""
        """Where the Peer service answers (set once it does)."""
        self.store = store
        self.peers = peers
        self.sender_check = sender_check
        self.servicer = servicer
        self.bulk = bulk
        self._server = server
        """The Peer service's gRPC server (None: ``peer_address`` is off); serving once
        :meth:`start` bound it."""
        self._serving = False
        self.replicator = replicator
        self.source = source

    async def start(
        self,
        service: Callable[[str, Callable[[], Coroutine[Any, Any, None]]], None],
        spawn: Callable[[str, Coroutine[Any, Any, None]], None],
    ) -> None:
        """Load the replicas held, serve them, start replicating and pre-staging."""
        held = await self.io.run(self.store.load)
        server = self._server
        if server is not None:
            if self.tls is None:
                port = server.add_insecure_port(self.listen)
            else:
                port = server.add_secure_port(self.listen, self.tls.server_credentials())
            if not port:
                raise FailedPrecondition(
                    f"cannot listen on peer_address {self.listen}: choose a free HOST:PORT"
                )
            host = self.listen.rpartition(":")[0]
            bind = host.strip("[]") or "0.0.0.0"
            try:
                if self.data_port >= 0:  # -1: replica bytes through gRPC only
                    await self.io.run(self.bulk.start, bind, self.data_port)
            except OSError as exc:
                await server.stop(None)
                raise FailedPrecondition(
                    f"cannot listen on peer_data_port {self.data_port} on {bind}: "
                    f"{exc.strerror}; choose a free port (0: any, -1: none)"
                ) from None
            data_port = self.bulk.port
            await server.start()
            self._serving = True
            self.address = f"{host}:{port}"
            log.info(
                "peer service on %s, replica data on port %d (%d replicas held)%s",
                self.address, data_port, held, ", mutual TLS" if self.tls else "",
            )  # fmt: skip
        if self.replicator is not None:
            service("replicator", self.replicator.run)
        if self.source is not None:
            self.prestaging = True
            spawn("prestage", self.prestage())

    async def prestage(self) -> None:
        """Take back from the peers every job's newest step this node holds no copy
        of (a node that lost its disk), before the trainer asks."""
        assert self.source is not None
        try:
            try:
                jobs = sorted({job for job, _ in await self.source.replicas()})
            except Exception as exc:
                log.warning("cannot ask the peers what they hold (%s)", exc)
                return
            for job in jobs:
                await self.source.ensure(job)
        finally:
            self.prestaging = False

    def halt(self) -> None:
        """Tell the replicator to return (the supervisor then waits for it)."""
        if self.replicator is not None:
            self.replicator.stop()

    async def stop(self) -> None:
        """Stop serving and close the channels."""
        if self._server is not None and self._serving:
            self.bulk.stop()
            await self._server.stop(grace=2)
        if self.source is not None:
            self.source.close()
        await self.peers.close()

    def status(self) -> dict[str, Any]:
        """The peer fields of the daemon's status."""
        errors = [self.peers.last_error, self.replicator.last_error if self.replicator else ""]
        return {
            "peer_address": self.address,
            "peer_data_port": self.bulk.port,
            "peers_known": len(self.peers.names),
            "replicas_held": len(self.store.list()),
            "replicas_held_bytes": self.store.held_bytes,
            "replicated_bytes": self.replicator.sent_bytes if self.replicator else 0,
            "peer_fetched_bytes": self.source.fetched_bytes if self.source else 0,
            "peer_prestaged_bytes": self.source.staged_bytes if self.source else 0,
            "peer_prestaging": self.prestaging,
            "peer_served_bytes": self.servicer.served_bytes + self.bulk.served_bytes,
            "peer_received_bytes": self.servicer.received_bytes + self.bulk.received_bytes,
            "peer_error": next((e for e in errors if e), ""),
        }
