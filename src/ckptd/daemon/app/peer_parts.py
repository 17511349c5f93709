"""The peer tier's parts, built for the composition root from :class:`PeerOptions`.

Apart from compose.py only for size: every part (the TLS files, the links to the
peers, the replica store, the Peer service and its gRPC server, the bulk listener,
the replicator and the source restoring a lost disk from peers) is built here,
before anything serves, and handed to :class:`PeerTier`, which binds and starts
them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from ckptd.core.errors import FailedPrecondition, InvalidArgument
from ckptd.core.wire import CHANNEL_OPTIONS
from ckptd.proto import ckptd_pb2_grpc as pb_grpc

from ..catalog.roles import Copies
from ..io import IoPool
from ..local.store import LocalStore
from ..peer.identity import BoundBulkServer, SenderCheck
from ..peer.link import Limiter, Peers, read_token
from ..peer.options import PeerOptions
from ..peer.replicas import ReplicaStore
from ..peer.replicator import Replicator
from ..peer.service import PeerServicer
from ..peer.source import Learn, OwnerFound, PeerSource, PrestageMemory
from ..peer.tier import PeerTier
from ..peer.tls import PeerTls

OwnerOf = Callable[[str], int | None]
"""The uid a job belongs to on this node (None: nobody's)."""


def build_peer_tier(
    options: PeerOptions,
    catalog: Copies,
    store: LocalStore,
    io: IoPool,
    memory: PrestageMemory,
    owners: tuple[OwnerOf, OwnerFound],
    learn: Learn,
) -> PeerTier:
    """Every part of the peer tier, wired; ``memory``: where pre-staged files also go
    into shared memory (the memory tier); ``owners``: each job's owner here, and
    where an owner a replica came with is told (api/access.py); ``learn``: learns
    what the bucket holds of a job (the pre-staging's comparison). Called on the
    daemon's event loop, which the bulk listener's threads ask for sender checks.
    Raises FailedPrecondition (a bad token file or TLS files) with what to fix."""
    try:
        token = read_token(options.peer_token_file)
    except InvalidArgument as exc:
        raise FailedPrecondition(str(exc)) from None
    tls = PeerTls.load(options.tls)
    replicas = ReplicaStore(store.root, options.peer_budget_bytes)
    peers = Peers(catalog.node_id, options.peers, token, tls)
    # A replica is taken only from the node it claims to be (identity.py).
    sender_check = SenderCheck(options.peer_identity, peers, asyncio.get_running_loop())
    bulk = BoundBulkServer(
        sender_check,
        replicas,
        token,
        tls,
        options.peer_bulk_deadline_seconds,
        options.peer_idle_seconds,
    )
    servicer = PeerServicer(
        catalog.node_id,
        token,
        replicas,
        io.run,
        sender_check=sender_check,
        idle=options.peer_idle_seconds,
        data_port=lambda: bulk.port,
    )
    server = None
    if options.serves:
        server = grpc.aio.server(options=CHANNEL_OPTIONS)
        pb_grpc.add_PeerServicer_to_server(servicer, server)
    replicator = source = None
    if options.peers:
        replicator = Replicator(
            catalog,
            store,
            io,
            peers,
            options.peer_replicas,
            Limiter(options.peer_bandwidth_bytes),
            options.peer_max_lag_seconds,
            owner_of=owners[0],
        )
        source = PeerSource(catalog, store, io, peers, memory, owner_found=owners[1], learn=learn)
    return PeerTier(
        options, io, tls, replicas, peers, sender_check, servicer, bulk, server, replicator, source
    )
