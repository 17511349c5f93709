"""How daemons reach each other: the shared token, the bandwidth cap, the peer list.

Every Peer call carries ``authorization: Bearer <token>``, the token being the
contents of ``peer_token_file`` (the same file on every node, e.g. one Kubernetes
Secret); the server compares it in constant time and answers UNAUTHENTICATED to
anything else. With the ``peer_tls_*`` files, calls also go over mutual TLS (tls.py).
The peer list is ``peers``: ``HOST:PORT`` entries, a name that resolves to several
addresses (a Kubernetes headless Service) counting each.
Peers are known by the node name they give (``Hello``); a node's replicas go to
the next ``peer_replicas`` nodes after it in name order that answer, so each node
holds the replicas of a few others and every node's are spread the same way.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ckptd.core.errors import InvalidArgument
from ckptd.core.names import UNKNOWN_OWNER, Owner, check_name, owner_or_unknown
from ckptd.core.wire import CHANNEL_OPTIONS, RECONNECT_OPTIONS
from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import ckptd_pb2_grpc as pb_grpc

from .tls import PeerTls, canonical_host

log = logging.getLogger("ckptd.peer")

CHUNK = 2**20
"""Bytes per ReplicaChunk (well under gRPC's message limit)."""
MIN_TOKEN_BYTES = 16
HELLO_SECONDS = 5.0
"""How long a peer may take to say who it is."""
REFRESH_SECONDS = 30.0
"""How long the peers' names are trusted before they are asked again."""
CLOSE_GRACE_SECONDS = 900.0
"""How long calls on a channel replaced by renewed certificates may go on."""
RETRY_SECONDS = 2.0
"""How soon the peers are asked again while some address did not answer."""


def owner_message(owner: Owner) -> pb.JobOwner | None:
    """A job's owner on the wire (None: not known, the field left unset)."""
    uid, known = owner
    if not known:
        return None
    return pb.JobOwner() if uid is None else pb.JobOwner(uid=uid)


def owner_of_message(message: Any) -> Owner:
    """The owner a ReplicaChunk or Replica carries (unset, or not a uid: not known)."""
    if not message.HasField("owner"):
        return UNKNOWN_OWNER
    return owner_or_unknown({"owner": message.owner.uid if message.owner.HasField("uid") else None})


def read_token(path: str) -> str:
    """The shared token in ``path`` (surrounding whitespace removed); refused when the
    file lets its group or anyone else read it (whoever reads the token may act as a
    peer: take and serve replicas)."""
    try:
        mode = os.stat(path).st_mode
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise InvalidArgument(
            f"cannot read peer_token_file {path}: {exc.strerror}; give a readable file "
            "holding the token every daemon of the job shares"
        ) from None
    if mode & 0o044:
        readers = ((0o040, "its group"), (0o004, "everyone"))
        who = " and ".join(w for bit, w in readers if mode & bit)
        raise InvalidArgument(
            f"peer_token_file {path} is readable by {who} (mode {stat.S_IMODE(mode):04o}): "
            f"anyone who reads it can act as a peer; run `chmod 600 {path}` (in Kubernetes, "
            "mount the Secret with defaultMode 0400)"
        )
    if len(token.encode()) < MIN_TOKEN_BYTES:
        raise InvalidArgument(
            f"peer_token_file {path} holds {len(token.encode())} bytes; use a random token "
            f"of at least {MIN_TOKEN_BYTES} (e.g. `openssl rand -hex 32`)"
        )
    return token


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata every Peer call carries."""
    return (("authorization", f"Bearer {token}"),)


def authorized(context: Any, token: str) -> bool:
    """Whether a call carries ``token`` (compared in constant time)."""
    sent = dict(context.invocation_metadata() or ()).get("authorization", "")
    return hmac.compare_digest(str(sent).encode(), f"Bearer {token}".encode())


class Limiter:
    """At most ``rate`` bytes per second over any second (a token bucket holding up
    to one second's worth): replication never takes the disk or the network from
    saves and the drain for long."""

    def __init__(self, rate: float, clock: Any = time.monotonic) -> None:
        self.rate = float(rate)
        self._clock = clock
        self._level = self.rate
        self._at = clock()

    async def take(self, n: int) -> None:
        """Wait until ``n`` more bytes may go."""
        now = self._clock()
        self._level = min(self.rate, self._level + (now - self._at) * self.rate)
        self._at = now
        self._level -= n
        if self._level < 0:
            await asyncio.sleep(-self._level / self.rate)


@dataclass(frozen=True)
class Peer:
    """A daemon reachable at ``address`` calling itself ``node``."""

    node: str
    address: str
    data_port: int = 0
    """Its bulk data listener's port (bulk.py) on the same host; 0: none."""
    host: str = ""
    """The name it was found under (its ``peers`` entry's host): the name its TLS
    certificate must hold; empty: its IP address."""

    @property
    def data_address(self) -> tuple[str, int]:
        """Where its bulk data listener answers."""
        return (self.address.rpartition(":")[0].strip("[]"), self.data_port)


def resolve(entries: tuple[str, ...]) -> dict[str, str]:
    """Every ``IP:PORT`` the ``HOST:PORT`` entries name (a name with several
    addresses, a headless Service's, gives each), with the host of the first entry
    naming it; an entry that does not resolve is logged and skipped (its pod may not
    exist yet)."""
    out: dict[str, str] = {}
    for entry in entries:
        host, _, port = entry.rpartition(":")
        host = canonical_host(host)
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError) as exc:
            log.warning("peer %s does not resolve (%s); skipped for now", entry, exc)
            continue
        for family, _, _, _, addr in infos:
            ip = str(addr[0])
            port_no = int(addr[1])
            text = f"[{ip}]:{port_no}" if family == socket.AF_INET6 else f"{ip}:{port_no}"
            out.setdefault(text, host)
    return out


class Peers:
    """The other daemons of the job, by node name, asked again every
    :data:`REFRESH_SECONDS` (a replaced pod comes back under a new address)."""

    def __init__(
        self, me: str, entries: tuple[str, ...], token: str, tls: PeerTls | None = None
    ) -> None:
        self.me = me
        self.entries = entries
        self.token = token
        self.tls = tls
        """Mutual TLS for every call and data connection (None: plain TCP)."""
        self.metadata = auth_metadata(token)
        self._channels: dict[str, tuple[grpc.aio.Channel, int, str]] = {}
        """Per address: the channel, the TLS files' generation and the name it checks."""
        self._retired: list[grpc.aio.Channel] = []
        self._closing: set[asyncio.Future[None]] = set()
        self._hosts: dict[str, str] = {}
        """The host name each address was found under (``peers``)."""
        self._known: list[Peer] = []
        self._at = -1e18
        self._complete = False
        self.last_error = ""
        """Why the last peer that did not answer did not (status)."""

    @property
    def names(self) -> list[str]:
        """The node names of the peers that answered last time they were asked."""
        return [p.node for p in self._known]

    def stub(self, address: str) -> pb_grpc.PeerStub:
        """A stub over one channel per address (kept)."""
        ip = address.rpartition(":")[0].strip("[]")
        name = self.tls.hostname(self._hosts.get(address) or ip) if self.tls else ""
        channel, generation, made_for = self._channels.get(address, (None, 0, ""))
        if (
            channel is not None
            and self.tls is not None
            and (self.tls.refresh() or self.tls.generation != generation or made_for != name)
        ):
            # Renewed certificate files, or the address now names another peer entry:
            # new calls on a new channel; the old one closes once its calls are done
            # (a transfer under way keeps its connection).
            self._retire(channel)
            channel = None
        if channel is None:
            # Peers restart and start in any order: retry a refused address within a
            # second, not after gRPC's default backoff of up to two minutes.
            options: list[tuple[str, Any]] = CHANNEL_OPTIONS + RECONNECT_OPTIONS
            if self.tls is None:
                channel = grpc.aio.insecure_channel(address, options=options)
            else:
                if name != canonical_host(ip):  # gRPC checks the target's IP otherwise
                    options = [*options, ("grpc.ssl_target_name_override", name)]
                credentials, generation = self.tls.channel_credentials()
                channel = grpc.aio.secure_channel(address, credentials, options=options)
            self._channels[address] = (channel, generation, name)
        return pb_grpc.PeerStub(channel)

    def _retire(self, channel: grpc.aio.Channel) -> None:
        self._retired.append(channel)
        closing = asyncio.ensure_future(channel.close(grace=CLOSE_GRACE_SECONDS))
        self._closing.add(closing)

        def closed(task: asyncio.Future[None]) -> None:
            self._closing.discard(task)
            if not task.cancelled():
                self._retired.remove(channel)

        closing.add_done_callback(closed)

    async def known(self, fresh: bool = False) -> list[Peer]:
        """The peers that said who they are (not this node), by node name."""
        # Until every address has answered (peers start in any order), ask again soon.
        wait = REFRESH_SECONDS if self._complete else RETRY_SECONDS
        if not fresh and time.monotonic() - self._at < wait:
            return self._known
        hosts = await asyncio.to_thread(resolve, self.entries)
        self._hosts.update(hosts)
        addresses = list(hosts)
        found = await asyncio.gather(*(self._hello(a) for a in addresses))
        named = {p.node: p for p in found if p is not None and p.node != self.me}
        self._known = [named[n] for n in sorted(named)]
        self._complete = bool(addresses) and None not in found
        self._at = time.monotonic()
        return self._known

    async def _hello(self, address: str) -> Peer | None:
        try:
            resp = await self.stub(address).Hello(
                pb.PeerHelloRequest(), metadata=self.metadata, timeout=HELLO_SECONDS
            )
            host = self._hosts.get(address, "")
            return Peer(check_name("node", resp.node), address, resp.data_port, host)
        except (grpc.RpcError, InvalidArgument) as exc:
            self.fail(address, exc)
            return None

    def fail(self, address: str, exc: BaseException) -> None:
        """Note a peer that did not answer (the status shows the last one)."""
        reason = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        self.last_error = f"{address}: {reason}"
        log.warning("peer %s: %s", address, reason)

    async def ring(self) -> list[Peer]:
        """The peers in the order this node's replicas go to them: the nodes after
        this one by name, wrapping around."""
        peers = await self.known()
        after = [p for p in peers if p.node > self.me]
        return after + [p for p in peers if p.node < self.me]

    async def close(self) -> None:
        """Close every channel."""
        for task in list(self._closing):
            task.cancel()
        for channel in [*self._retired, *(c for c, _, _ in self._channels.values())]:
            await channel.close()
        self._retired.clear()
        self._channels.clear()
