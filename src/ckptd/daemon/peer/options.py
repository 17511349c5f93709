"""The peer tier's configuration keys, declared here once (see local/options.py):
``peer_*`` and ``peers``."""

from __future__ import annotations

from dataclasses import dataclass

OFF = ("", "off", "none", "false")
"""Values of ``peer_address`` that mean no Peer service."""


@dataclass(frozen=True)
class PeerTlsFiles:
    """``peer_tls_*``: mutual TLS between the daemons (tls.py); no certificate: plain TCP."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    server_name: str = ""


@dataclass(frozen=True)
class PeerOptions:
    """What the peer tier is configured with."""

    peer_address: str = "off"
    """``HOST:PORT`` (TCP) where the Peer service takes and serves replicas of other
    daemons' steps; ``off``: none (port 0: any free port, shown in status)."""
    peer_data_port: int = 0
    """TCP port (on ``peer_address``'s host) of the listener that serves replica bytes
    to restoring nodes (sendfile, ~3x gRPC's rate); 0: any free port, told to peers by
    the Peer service; -1: none (the bytes go through the Peer service: one port)."""
    peers: tuple[str, ...] = ()
    """The other daemons of the job, ``HOST:PORT`` each (a name resolving to several
    addresses, a Kubernetes headless Service's, counts each); this one is skipped."""
    peer_replicas: int = 1
    """How many peers get a replica of each job's newest local step."""
    peer_token_file: str = ""
    """File holding the token every daemon of the job shares; required with
    ``peer_address`` or ``peers`` (peer calls without it are refused)."""
    peer_tls_cert_file: str = ""
    """PEM certificate this daemon shows its peers; with ``peer_tls_key_file`` and
    ``peer_tls_ca_file``, peer traffic is mutual TLS (peer/tls.py). Empty: plain TCP."""
    peer_tls_key_file: str = ""
    """PEM private key of ``peer_tls_cert_file``."""
    peer_tls_ca_file: str = ""
    """PEM CA bundle the peers' certificates must chain to."""
    peer_tls_server_name: str = ""
    """Name every peer's certificate holds; empty: the host of its ``peers`` entry."""
    peer_identity: str = "auto"
    """How a replica's sender is proven to be the node it claims (peer/identity.py):
    ``certificate`` (its TLS certificate names the node), ``address`` (it sends from
    that node's ``peers`` address); ``auto``: certificate with the peer_tls_* files
    unless ``peer_tls_server_name`` is set (one certificate shared by every node)."""
    peer_bandwidth_bytes: int = 512 * 2**20
    """Bytes per second replication may send (saves and the drain keep the rest)."""
    peer_max_lag_seconds: float = 30.0
    """Replication yields to saves being written (STAGING), but once a job's replica
    has been behind its newest local step this long it sends regardless (a continuous
    save loop leaves no gap; the replica is the node-loss copy)."""
    peer_budget_bytes: int = 64 * 2**30
    """Disk this daemon gives to replicas of other nodes' steps."""
    peer_bulk_deadline_seconds: float = 120.0
    """Seconds one request to the bulk data listener may take from its connection, a
    ranged read's bytes included (a caller that trickles is cut there); a caller has
    at most 5 s of it to show the token."""
    peer_idle_seconds: float = 300.0
    """Seconds a replica being received may go without a byte before it is dropped
    with its share of ``peer_budget_bytes``; more than ``peer_max_lag_seconds`` (a
    sender pauses for its node's saves that long)."""

    @property
    def tls(self) -> PeerTlsFiles:
        """The ``peer_tls_*`` files together."""
        return PeerTlsFiles(
            self.peer_tls_cert_file,
            self.peer_tls_key_file,
            self.peer_tls_ca_file,
            self.peer_tls_server_name,
        )

    @property
    def serves(self) -> bool:
        """Whether this daemon runs the Peer service (``peer_address`` is not off)."""
        return self.peer_address.strip().lower() not in OFF

    @property
    def enabled(self) -> bool:
        """Whether the daemon has a peer tier at all (it serves, or sends to peers)."""
        return self.serves or bool(self.peers)
