"""Mutual TLS between daemons, from PEM files named in the config.

With ``peer_tls_cert_file``, ``peer_tls_key_file`` and ``peer_tls_ca_file`` set, a
daemon serves the Peer service and the data listener over TLS only, asks every caller
for a certificate signed by that CA, and shows its own when it calls a peer: both ends
are authenticated and replica bytes and the token travel encrypted. The token is still
required (it says the caller belongs to this job; the CA may sign other services too).

The name checked in a peer's certificate (its subjectAltName) is the host of the
``peers`` entry it was found under (a DNS name, else its IP address; a headless
Service's name is checked in every pod's certificate), or ``peer_tls_server_name``
when set: a cluster rarely issues a certificate per pod, so every node may share one
naming, say, ``ckptd-peer``. Certificates are read at start-up; a renewed one is taken at the next
restart (cert-manager rotates the Secret's files; the DaemonSet rolls).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from ckptd.core.errors import FailedPrecondition


@dataclass(frozen=True)
class PeerTls:
    """The node's certificate and key and the CA its peers' certificates must chain to."""

    cert_file: str
    key_file: str
    ca_file: str
    server_name: str = ""
    """The name every peer's certificate must hold; empty: the host of its ``peers``
    entry."""
    _pem: dict[str, bytes] = field(default_factory=dict, repr=False, compare=False)
    _contexts: dict[str, ssl.SSLContext] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def load(cls, cfg: Any) -> PeerTls | None:
        """The TLS settings of ``cfg`` (None: plain TCP), files read and checked now so
        that a wrong path or a key not matching its certificate stops the start-up."""
        if not cfg.peer_tls_cert_file:
            return None
        tls = cls(
            cfg.peer_tls_cert_file,
            cfg.peer_tls_key_file,
            cfg.peer_tls_ca_file,
            cfg.peer_tls_server_name,
        )
        for key in ("cert_file", "key_file", "ca_file"):
            path = getattr(tls, key)
            try:
                tls._pem[key] = Path(path).read_bytes()
            except OSError as exc:
                raise FailedPrecondition(
                    f"cannot read peer_tls_{key} {path}: {exc.strerror}; give a readable "
                    "PEM file (a mounted Secret's tls.crt, tls.key, ca.crt)"
                ) from None
        tls.server_context()
        tls.client_context()
        return tls

    def server_context(self) -> ssl.SSLContext:
        """For the data listener: its certificate shown, a caller's required."""
        return self._context("server", ssl.PROTOCOL_TLS_SERVER)

    def client_context(self) -> ssl.SSLContext:
        """For a data connection to a peer: the peer's certificate checked, ours shown."""
        return self._context("client", ssl.PROTOCOL_TLS_CLIENT)

    def hostname(self, host: str) -> str:
        """The name a peer found under ``host`` must hold in its certificate."""
        return self.server_name or host.strip("[]")

    def server_credentials(self) -> grpc.ServerCredentials:
        """For the Peer service: callers without a certificate from the CA are refused."""
        return grpc.ssl_server_credentials(
            [(self._pem["key_file"], self._pem["cert_file"])],
            root_certificates=self._pem["ca_file"],
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """For calling a peer's Peer service."""
        return grpc.ssl_channel_credentials(
            root_certificates=self._pem["ca_file"],
            private_key=self._pem["key_file"],
            certificate_chain=self._pem["cert_file"],
        )

    def _context(self, side: str, protocol: int) -> ssl.SSLContext:
        context = self._contexts.get(side)
        if context is not None:
            return context
        context = ssl.SSLContext(protocol)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
            context.load_verify_locations(self.ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise FailedPrecondition(
                f"peer TLS files {self.cert_file}, {self.key_file}, {self.ca_file}: {exc}; "
                "give a PEM certificate, its own private key and the CA that signed the "
                "peers' certificates"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED  # the peer shows a certificate, both ways
        self._contexts[side] = context
        return context
