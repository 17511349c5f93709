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
naming, say, ``ckptd-peer``.

Certificates are renewed under a running daemon (cert-manager rewrites the Secret's
files well before they expire; a training run outlives a certificate): the files are
looked at again at most every :data:`RELOAD_SECONDS` as connections are made, and
when they changed and still make a usable pair, new connections use them (the Peer
service through gRPC's certificate fetcher, calls to peers on new channels). Files
caught half-written, or a key not matching its certificate, are logged and the
previous ones kept.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from ckptd.core.errors import FailedPrecondition

from .options import PeerTlsFiles

log = logging.getLogger("ckptd.peer")

RELOAD_SECONDS = 30.0
"""How often, at most, the files are looked at again for a renewed certificate."""
_KEYS = ("cert_file", "key_file", "ca_file")


@dataclass(frozen=True)
class _Loaded:
    """One generation of the files: their bytes and the contexts made from them."""

    pem: dict[str, bytes]
    server: ssl.SSLContext
    client: ssl.SSLContext


class PeerTls:
    """The node's certificate and key and the CA its peers' certificates must chain
    to, reloaded when the files change."""

    def __init__(
        self,
        cert_file: str,
        key_file: str,
        ca_file: str,
        server_name: str = "",
        *,
        reload_seconds: float = RELOAD_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.files = {"cert_file": cert_file, "key_file": key_file, "ca_file": ca_file}
        self.server_name = server_name
        """The name every peer's certificate must hold; empty: the host of its
        ``peers`` entry."""
        self.reload_seconds, self._clock = reload_seconds, clock
        self.generation = 0
        """How many times renewed files were taken (channels made before are remade)."""
        self._lock = threading.Lock()
        if server_name and not _valid_name(server_name):
            raise FailedPrecondition(
                f"peer_tls_server_name {server_name!r} is not a host name; give the DNS name "
                "every peer's certificate holds"
            )
        self._checked = clock()
        self._stamp = self._stamps()
        self._refused: tuple[tuple[int, int, int], ...] | None = None
        self._now = self._load()
        self._served_generation = 0

    @classmethod
    def load(cls, files: PeerTlsFiles) -> PeerTls | None:
        """The TLS of ``files`` (None: plain TCP), the files read and checked now so
        that a wrong path or a key not matching its certificate stops the start-up."""
        if not files.cert_file:
            return None
        return cls(files.cert_file, files.key_file, files.ca_file, files.server_name)

    def refresh(self) -> bool:
        """Take the files again if they changed (looked at, at most, every
        ``reload_seconds``); whether new ones were taken."""
        with self._lock:
            now = self._clock()
            if now - self._checked < self.reload_seconds:
                return False
            self._checked = now
            try:
                stamp = self._stamps()
            except FailedPrecondition:
                return False  # a file gone for a moment (a Secret being swapped)
            if stamp == self._stamp:
                return False
            try:
                loaded = self._load()
            except FailedPrecondition as exc:
                # Tried again next time (files caught mid-write settle), said once.
                if stamp != self._refused:
                    self._refused = stamp
                    log.warning("peer TLS files changed but cannot be used, kept the last: %s", exc)
                return False
            self._now, self._stamp = loaded, stamp
            self.generation += 1
        log.info("peer TLS certificate renewed from %s", self.files["cert_file"])
        return True

    def server_context(self) -> ssl.SSLContext:
        """For the data listener: its certificate shown, a caller's required."""
        self.refresh()
        return self._now.server

    def client_context(self) -> ssl.SSLContext:
        """For a data connection to a peer: the peer's certificate checked, ours shown."""
        self.refresh()
        return self._now.client

    def hostname(self, host: str) -> str:
        """The name a peer found under ``host`` must hold in its certificate."""
        return self.server_name or canonical_host(host)

    def server_credentials(self) -> grpc.ServerCredentials:
        """For the Peer service: callers without a certificate from the CA are refused;
        gRPC asks :meth:`_fetch` for renewed files before each new connection."""
        self._served_generation = self.generation
        return grpc.dynamic_ssl_server_credentials(
            self._certificate_configuration(), self._fetch, require_client_authentication=True
        )

    def channel_credentials(self) -> tuple[grpc.ChannelCredentials, int]:
        """For calling a peer's Peer service, and the generation of the files they
        came from (a channel is remade once :attr:`generation` moves past it)."""
        self.refresh()
        with self._lock:  # the files and their generation, from one renewal
            pem, generation = self._now.pem, self.generation
        credentials = grpc.ssl_channel_credentials(
            root_certificates=pem["ca_file"],
            private_key=pem["key_file"],
            certificate_chain=pem["cert_file"],
        )
        return credentials, generation

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        self.refresh()
        if self.generation == self._served_generation:
            return None
        self._served_generation = self.generation
        return self._certificate_configuration()

    def _certificate_configuration(self) -> grpc.ServerCertificateConfiguration:
        pem = self._now.pem
        return grpc.ssl_server_certificate_configuration(
            [(pem["key_file"], pem["cert_file"])], root_certificates=pem["ca_file"]
        )

    def _stamps(self) -> tuple[tuple[int, int, int], ...]:
        """What tells a rewritten file (through the symlinks a Secret mount swaps)."""
        out = []
        for key in _KEYS:
            try:
                st = os.stat(self.files[key])
            except OSError as exc:
                raise _unreadable(key, self.files[key], exc) from None
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def _load(self) -> _Loaded:
        pem = self._read()
        loaded = _Loaded(
            pem, self._context(ssl.PROTOCOL_TLS_SERVER), self._context(ssl.PROTOCOL_TLS_CLIENT)
        )
        # gRPC gets the bytes, ssl the paths: the same files only if nothing wrote them
        # in between (a renewal caught mid-way is taken at the next look).
        if self._read() != pem:
            raise FailedPrecondition("peer TLS files changed while they were read")
        return loaded

    def _read(self) -> dict[str, bytes]:
        pem = {}
        for key in _KEYS:
            try:
                pem[key] = Path(self.files[key]).read_bytes()
            except OSError as exc:
                raise _unreadable(key, self.files[key], exc) from None
        return pem

    def _context(self, protocol: int) -> ssl.SSLContext:
        context = ssl.SSLContext(protocol)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        cert, key, ca = (self.files[k] for k in _KEYS)
        try:
            # An encrypted key fails here rather than prompting on the terminal.
            context.load_cert_chain(cert, key, password=lambda: b"")
            context.load_verify_locations(ca)
        except (ssl.SSLError, OSError) as exc:
            raise FailedPrecondition(
                f"peer TLS files {cert}, {key}, {ca}: {exc}; give a PEM certificate, its "
                "own private key and the CA that signed the peers' certificates"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED  # the peer shows a certificate, both ways
        return context


def _valid_name(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}", name) is not None


def canonical_host(host: str) -> str:
    """``host`` without brackets; an IP address in its canonical spelling (gRPC compares
    a certificate's IP names as text)."""
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _unreadable(key: str, path: str, exc: OSError) -> FailedPrecondition:
    return FailedPrecondition(
        f"cannot read peer_tls_{key} {path}: {exc.strerror}; give a readable PEM file "
        "(a mounted Secret's tls.crt, tls.key, ca.crt)"
    )
