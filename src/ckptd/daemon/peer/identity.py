"""Who sent a replica: a replica is taken only as its authenticated sender's own.

The token says a caller belongs to the job, not which node it is: anyone holding it
could otherwise push a replica claiming to be another node's (a forged step that
node would restore after losing its disk). So the manifest's ``node`` must be the
sender's identity, checked one of two ways (``peer_identity``):

- ``certificate`` (the default with the ``peer_tls_*`` files and no
  ``peer_tls_server_name``): the sender's TLS client certificate, already checked
  against the CA, must name the node in its subjectAltName (``DNS:<node_id>``) or
  its common name. Each node gets its own certificate naming its ``node_id`` (and
  the host its ``peers`` entry gives, which its peers check as a server name).
- ``address`` (the default without TLS, or with ``peer_tls_server_name``: one
  certificate every node shares names no node): the sender's IP address must be an
  address of the ``peers`` entry whose daemon answered ``Hello`` with that node
  name. This holds against a token holder elsewhere on the network, not against one
  that can send from a peer's own address (a process on the peer's host, another
  daemon on the same host, a spoofing router); there, use a certificate per node.

A receiver with no ``peers`` entry for a node refuses that node's replicas.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ckptd.core.errors import FailedPrecondition, PermissionDenied
from ckptd.core.manifest import Manifest

from .bulk import BulkServer
from .link import Peers
from .tls import canonical_host

log = logging.getLogger("ckptd.peer")

MODES = ("auto", "certificate", "address")
CHECK_SECONDS = 15.0
"""How long a bulk receiver waits for the peers to say who they are (then it refuses)."""


@dataclass(frozen=True)
class Sender:
    """The other end of a connection that sends a replica."""

    ip: str
    names: frozenset[str] | None = None
    """The names its verified client certificate holds (None: no TLS)."""


def _ip(text: str) -> str:
    """An address in one spelling (an IPv4-mapped IPv6 address as the IPv4 one)."""
    try:
        ip = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return text
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def grpc_sender(context: Any) -> Sender:
    """The sender of a gRPC call (``context.peer()`` is ``ipv4:IP:PORT`` or
    ``ipv6:[IP]:PORT``, the brackets percent-encoded by some gRPC versions)."""
    peer = unquote(str(context.peer() or ""))
    ip = _ip(peer.partition(":")[2].rpartition(":")[0])
    auth = context.auth_context() or {}
    if b"ssl" not in auth.get("transport_security_type", ()):
        return Sender(ip)
    names = [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]
    return Sender(ip, frozenset(n.decode(errors="replace") for n in names))


def socket_sender(conn: socket.socket) -> Sender:
    """The sender on a bulk data connection (its certificate when it is TLS)."""
    ip = _ip(str(conn.getpeername()[0]))
    if not isinstance(conn, ssl.SSLSocket):
        return Sender(ip)
    cert: Any = conn.getpeercert() or {}
    names = {v for kind, v in cert.get("subjectAltName", ()) if kind == "DNS"}
    names |= {v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"}
    return Sender(ip, frozenset(names))


class SenderCheck:
    """Refuses a replica whose manifest names a node other than its sender."""

    def __init__(
        self, mode: str, peers: Peers, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        if mode not in MODES:
            raise FailedPrecondition(
                f"invalid value for 'peer_identity': {mode!r}; use one of {MODES}"
            )
        if mode == "certificate" and peers.tls is None:
            raise FailedPrecondition(
                "peer_identity = 'certificate' needs the peer_tls_* files (mutual TLS)"
            )
        if mode == "auto":  # a certificate every node shares (its name set) names no node
            shared = peers.tls is None or bool(peers.tls.server_name)
            mode = "address" if shared else "certificate"
        self.mode, self.peers = mode, peers
        self.loop = loop
        """The daemon's event loop: bulk threads ask on it (None: every check refused)."""

    async def check(self, node: str, sender: Sender) -> None:
        """Return if ``sender`` is ``node``'s daemon; else PermissionDenied, saying why."""
        if self.mode == "certificate":
            if sender.names is not None and node in sender.names:
                return
            held = ", ".join(sorted(sender.names or ())) or "no name"
            raise _refused(
                node, sender, f"its certificate names {held}; issue each node a certificate "
                f"whose subjectAltName holds DNS:<its node_id>, or set peer_identity = "
                "'address' for a certificate every node shares",
            )  # fmt: skip
        for fresh in (False, True):  # a replaced pod: its new address after a fresh Hello
            known = await self.peers.known(fresh=fresh)
            hosts = [p.address.rpartition(":")[0] for p in known if p.node == node]
            ips = {_ip(canonical_host(h)) for h in hosts}
            if _ip(sender.ip) in ips:
                return
        if not ips:
            why = (
                f"no `peers` entry of this daemon answers as {node}; list in `peers` "
                "every node whose replicas it holds"
            )
        else:
            why = f"{node} answers at {', '.join(sorted(ips))}"
        raise _refused(node, sender, why)

    def check_blocking(self, node: str, sender: Sender) -> None:
        """:meth:`check` from a bulk connection's thread."""
        if self.loop is None:
            raise _refused(node, sender, "this daemon is still starting; try again")
        future = asyncio.run_coroutine_threadsafe(self.check(node, sender), self.loop)
        try:
            future.result(CHECK_SECONDS)
        except TimeoutError:
            future.cancel()
            raise _refused(node, sender, "its peers did not say who they are; try again") from None


def _refused(node: str, sender: Sender, why: str) -> PermissionDenied:
    log.warning("replica claiming node %s from %s refused: %s", node, sender.ip, why)
    return PermissionDenied(
        f"replica refused: only node {node}'s own daemon may send its replicas, and the "
        f"sender ({sender.ip}) is not it: {why}"
    )


def claimed_node(raw: str) -> str:
    """The node a replica's manifest says it is from (ManifestInvalid if it is none)."""
    return Manifest.from_json(raw).node


class BoundBulkServer(BulkServer):
    """The bulk listener taking a pushed replica only from the node it claims to be."""

    def __init__(self, check: SenderCheck, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sender_check = check

    def _put(self, conn: socket.socket, req: dict[str, Any]) -> None:
        node = claimed_node(str(req.get("manifest", "")))
        self.sender_check.check_blocking(node, socket_sender(conn))
        super()._put(conn, req)
