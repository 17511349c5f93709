"""The peer tier's settings: a typed, frozen group the composition root builds from
the daemon's configuration (the keys ``peer_*`` and ``peers``), so the tier never
reads the configuration itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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
    """What the peer tier is configured with (each field is the key ``peer_<name>``,
    except ``node_id``, ``root`` and ``peers``)."""

    node_id: str
    root: Path
    address: str = "off"
    data_port: int = 0
    peers: tuple[str, ...] = ()
    replicas: int = 1
    token_file: str = ""
    tls: PeerTlsFiles = field(default_factory=PeerTlsFiles)
    identity: str = "auto"
    bandwidth_bytes: int = 512 * 2**20
    max_lag_seconds: float = 30.0
    budget_bytes: int = 64 * 2**30
    bulk_deadline_seconds: float = 120.0
    idle_seconds: float = 300.0

    @property
    def serves(self) -> bool:
        """Whether this daemon runs the Peer service (``peer_address`` is not off)."""
        return self.address.strip().lower() not in OFF

    @property
    def enabled(self) -> bool:
        """Whether the daemon has a peer tier at all (it serves, or sends to peers)."""
        return self.serves or bool(self.peers)
