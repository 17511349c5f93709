"""Replica bytes over plain TCP: the bulk listener beside the Peer gRPC service.

A node restoring reads byte ranges of replica files (``get``: ``sendfile`` on the
serving side, ``recv_into`` a reused buffer on the reading side), and a node
replicating pushes a replica's files back to back (``put``: read with O_DIRECT
into a reused buffer and sent from it; the receiver checks and writes it through
the replica store exactly as a ``PutReplica`` stream).

Why not the Peer gRPC service: Python gRPC moves ~0.3 GB/s per process on this kind
of host whatever the message size or the number of streams (every chunk is copied
into a message and out of it, under the interpreter lock), where a plain socket
moves ~1 GB/s here for a fraction of the CPU, CPU a replicating daemon takes from
the trainer beside it. gRPC keeps the control: ``Hello`` tells a peer this
listener's port (``data_port``); a daemon that gives none is served by gRPC.

The protocol, one request per connection:

- request: :data:`MAGIC`, a 4-byte little-endian length and the shared token, then
  a 4-byte length and that many bytes of JSON. The token is compared (in constant
  time) before the JSON is read, so only a daemon holding it can make this one
  read more than :data:`MAX_TOKEN` bytes.
- ``{"op": "get", "job", "source", "step", "file", "offset", "length"}``: answer
  ``OK`` and an 8-byte length, then exactly that many bytes of the file from
  ``offset``.
- ``{"op": "put", "job", "step", "manifest"[, "holder_for"]}`` (``holder_for``: the
  newer step this one is sent ahead of, as a step it references; replicas.py):
  answer ``HD`` and an 8-byte size
  (held already: send nothing) or ``GO``; then the replica's rank files back to
  back in manifest order; answer ``OK`` and the size once the replica is held.
- any refusal or failure: ``ER``, a 4-byte length and a UTF-8 reason.

Limits (:class:`BulkServer`): a caller must show the token within
:data:`AUTH_SECONDS` before it takes a transfer slot; a ``get`` is cut at
``peer_bulk_deadline_seconds`` from its connection, a ``put`` after
``peer_idle_seconds`` without a byte. The reading and pushing sides fall back to
the Peer gRPC service when this listener fails them (transfer.py, replicator.py).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from typing import Any

from ckptd.core.errors import CkptdError, InvalidArgument, Unauthenticated, Unavailable
from ckptd.core.names import check_name, check_step, owner_or_unknown

from .. import faults
from .deadline import Watchdog
from .link import CHUNK
from .replicas import Held, ReplicaStore
from .tls import PeerTls

log = logging.getLogger("ckptd.peer")

MAGIC = b"CKPTDPD2"
MAX_TOKEN = 1024
MAX_REQUEST = 64 * 2**20
"""A put's manifest (thousands of shards); read only from a caller with the token."""
AUTH_SECONDS = 5.0
"""How long a caller has, from its connection, to show the token (the TLS handshake
included); the request deadline cuts it shorter when that is shorter."""
MAX_UNAUTHENTICATED = 64
"""Connections not yet past the token check at once; more are closed at once."""
MAX_UNAUTHENTICATED_PER_SOURCE = 8
"""Of those, from one address (a restoring peer opens a handful)."""
DEADLINE_SECONDS = 120.0
"""Default of ``peer_bulk_deadline_seconds``: a whole request, a ranged read's bytes
included (a range is at most 64 MiB)."""
IDLE_SECONDS = 60.0
"""How long a reader waits on a silent peer mid-transfer."""
PUT_IDLE_SECONDS = 300.0
"""Default of ``peer_idle_seconds``: how long a receiver waits on a silent sender
(it yields to its node's saves for up to ``peer_max_lag_seconds``)."""
SEND_CHUNK = 8 * 2**20
"""Bytes per ``sendfile`` call (the failpoint between calls: tests)."""
MAX_CONNECTIONS = 32
"""Authenticated transfers at once."""


def request_frame(token: str, request: dict[str, Any]) -> bytes:
    """The bytes of one request."""
    key, body = token.encode(), json.dumps(request).encode()
    return MAGIC + struct.pack("<I", len(key)) + key + struct.pack("<I", len(body)) + body


class _Gate:
    """One connection's place in the listener's limits: among the unauthenticated
    (by its source address) until the token is checked, then a transfer slot."""

    def __init__(self, source: str, started: float, key: int) -> None:
        self.source, self.started, self.key = source, started, key
        self.ident = key  # its place among the unauthenticated (key changes later)
        self.waiting = True  # counted among the unauthenticated
        self.slot = False  # holds a transfer slot


class BulkServer:
    """Serves and takes replica bytes for the daemons holding the token, one thread
    per connection (socket calls and ``sendfile`` run outside the interpreter lock).

    A connection holds nothing scarce until it has shown the token: the callers
    without it share :data:`MAX_UNAUTHENTICATED` places (at most
    :data:`MAX_UNAUTHENTICATED_PER_SOURCE` per address, a newcomer closing the
    oldest when they are full: a daemon sends its token in its first bytes, so idle
    connections cannot keep it out) and :data:`AUTH_SECONDS`; only then does it
    take one of the :data:`MAX_CONNECTIONS` transfer slots. A request (a ranged
    read's bytes included) is cut at ``deadline`` seconds from its connection
    whatever it trickles; a put, whose sender may pause for its node's saves, is
    cut after ``idle`` seconds without a byte instead."""

    def __init__(
        self,
        store: ReplicaStore,
        token: str,
        tls: PeerTls | None = None,
        deadline: float = DEADLINE_SECONDS,
        idle: float = PUT_IDLE_SECONDS,
    ) -> None:
        self.store, self._token = store, token.encode()
        self._tls = tls
        self.deadline, self.idle = deadline, idle
        self._sock: socket.socket | None = None
        self._open = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        # The unauthenticated connections, oldest first: all, and by address.
        self._waiting: dict[int, _Gate] = {}
        self._by_source: dict[str, dict[int, _Gate]] = {}
        self._watchdog = Watchdog("ckptd-peer-bulk-deadline")
        self.served_bytes = 0
        """Bytes of replica files sent to restoring nodes (metrics)."""
        self.received_bytes = 0
        """Bytes of replicas taken (metrics)."""
        self.port = 0

    @property
    def cut(self) -> int:
        """Connections cut at their deadline or evicted (tests)."""
        return self._watchdog.fired

    def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host:port`` (0: any free port); the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
        self._sock, self.port = sock, int(sock.getsockname()[1])
        threading.Thread(target=self._accept, name="ckptd-peer-bulk", daemon=True).start()
        return self.port

    def stop(self) -> None:
        """Stop taking connections (transfers under way end with their peer)."""
        if self._sock is not None:
            with contextlib.suppress(OSError):  # shut down already
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed: the daemon stops
            # The token's deadline runs from the connection, the handshake included.
            gate = _Gate(str(addr[0]), time.monotonic(), 0)
            gate.key = gate.ident = self._watchdog.arm(conn, min(AUTH_SECONDS, self.deadline))
            with self._lock:
                mine = self._by_source.setdefault(gate.source, {})
                victim = None
                if len(mine) >= MAX_UNAUTHENTICATED_PER_SOURCE:
                    victim = next(iter(mine.values()))
                elif len(self._waiting) >= MAX_UNAUTHENTICATED:
                    victim = next(iter(self._waiting.values()))
                if victim is not None:
                    self._forget(victim)
                mine[gate.ident] = self._waiting[gate.ident] = gate
            if victim is not None:  # not logged: whoever floods the port would flood the log
                self._watchdog.fire(victim.key)
            threading.Thread(target=self._serve, args=(conn, gate), daemon=True).start()

    def _forget(self, gate: _Gate) -> None:
        """``gate`` is no longer among the unauthenticated (under the lock)."""
        if gate.waiting:
            gate.waiting = False
            del self._waiting[gate.ident]
            mine = self._by_source[gate.source]
            del mine[gate.ident]
            if not mine:
                del self._by_source[gate.source]

    def _serve(self, raw: socket.socket, gate: _Gate) -> None:
        try:
            with raw:
                try:
                    raw.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    raw.settimeout(min(AUTH_SECONDS, self.deadline))
                    if self._tls is None:
                        self._handle(raw, gate)
                    else:  # a caller without a certificate from the CA fails the handshake
                        context = self._tls.server_context()  # renewed files: taken here
                        with context.wrap_socket(raw, server_side=True) as conn:
                            self._handle(conn, gate)
                finally:
                    self._watchdog.disarm(gate.key)
        except OSError as exc:  # the other end went away, or its deadline passed
            log.info("peer transfer ended early: %s", exc)
        finally:
            with self._lock:
                self._forget(gate)
            if gate.slot:
                self._open.release()

    def _admit(self, conn: socket.socket, gate: _Gate) -> None:
        """The token is good: leave the unauthenticated, take a transfer slot, and run
        the rest of the request under the whole-request deadline."""
        if not self._watchdog.disarm(gate.key):
            raise OSError("the token came after its deadline, or newer connections took its place")
        with self._lock:
            self._forget(gate)
        if not self._open.acquire(blocking=False):
            log.warning("peer data connection refused: %d transfers at once", MAX_CONNECTIONS)
            raise Unavailable("too many transfers at once; try again")
        gate.slot = True
        left = gate.started + self.deadline - time.monotonic()
        gate.key = self._watchdog.arm(conn, max(left, 0.0))
        conn.settimeout(max(min(left, self.deadline), 0.001))

    def _handle(self, conn: socket.socket, gate: _Gate) -> None:
        try:
            self._authenticate(conn)
            self._admit(conn, gate)
            req = self._request(conn)
            op = "put" if req.get("op") == "put" else "get"
            if faults.armed(f"peer.bulk_{op}"):  # tests: a listener that fails
                faults.hit(f"peer.bulk_{op}")
            if op == "put":
                # A put's bytes come as its sender reads them, pausing for its node's
                # saves: bounded by silence, not by a deadline.
                self._watchdog.disarm(gate.key)
                self._put(conn, req)
                return
            path, offset, length = self._get_target(req)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except (CkptdError, OSError, ValueError, KeyError, TypeError) as exc:
            _refuse(conn, str(exc))
            return
        try:
            conn.settimeout(min(IDLE_SECONDS, self.deadline))
            self._send(conn, fd, offset, length)
        finally:
            os.close(fd)

    def _authenticate(self, conn: socket.socket) -> None:
        head = _recv_exact(conn, len(MAGIC) + 4)
        if head[: len(MAGIC)] != MAGIC:
            raise InvalidArgument("not a ckptd peer data request")
        (size,) = struct.unpack("<I", head[len(MAGIC) :])
        sent = _recv_exact(conn, size) if size <= MAX_TOKEN else b""
        if not hmac.compare_digest(sent, self._token):
            raise Unauthenticated(
                "peer data request without the shared token: give every daemon the "
                "same peer_token_file"
            )

    def _request(self, conn: socket.socket) -> dict[str, Any]:
        (size,) = struct.unpack("<I", _recv_exact(conn, 4))
        if size > MAX_REQUEST:
            raise InvalidArgument(f"request of {size} bytes (at most {MAX_REQUEST})")
        req = json.loads(_recv_exact(conn, size))
        if not isinstance(req, dict):
            raise InvalidArgument("a peer data request is a JSON object")
        return req

    def _get_target(self, req: dict[str, Any]) -> tuple[str, int, int]:
        job = check_name("job", str(req.get("job", "")))
        source = check_name("node", str(req.get("source", "")))
        path = self.store.path(job, source, check_step(int(req["step"])), str(req["file"]))
        offset, length = int(req["offset"]), int(req["length"])
        size_now = os.stat(path).st_size
        if offset < 0 or length < 0 or offset + length > size_now:
            raise InvalidArgument(f"range {offset}+{length} outside the file ({size_now} bytes)")
        return str(path), offset, length

    def _send(self, conn: socket.socket, fd: int, offset: int, length: int) -> None:
        conn.sendall(b"OK" + struct.pack("<Q", length))
        end = offset + length
        # Armed (tests): a chunk at a time, so that a peer dies mid-transfer even with
        # a file smaller than SEND_CHUNK.
        most = CHUNK if faults.armed("peer.serve_chunk") else SEND_CHUNK
        # socket.sendfile: os.sendfile on a socket with a timeout (non-blocking
        # underneath) stops at the first full send buffer; this waits for room.
        file = os.fdopen(fd, "rb", closefd=False)
        # TLS encrypts in user space: no sendfile (ssl's own fallback reads 8 KiB at a time).
        buf = memoryview(bytearray(CHUNK)) if self._tls is not None else None
        while offset < end:
            if buf is not None:
                sent = os.preadv(fd, [buf[: min(CHUNK, end - offset)]], offset)
                conn.sendall(buf[:sent])
            else:
                sent = conn.sendfile(file, offset, min(most, end - offset))
            if sent == 0:
                raise OSError("the replica file shrank while it was sent")
            offset += sent
            with self._lock:
                self.served_bytes += sent
            if faults.armed("peer.serve_chunk"):  # tests: a peer dying mid-transfer
                faults.hit("peer.serve_chunk")

    def _put(self, conn: socket.socket, req: dict[str, Any]) -> None:
        """Take a replica pushed by its source (checked like a PutReplica stream)."""
        job = check_name("job", str(req.get("job", "")))
        step, holder_for = check_step(int(req["step"])), int(req.get("holder_for", 0))
        owner = owner_or_unknown(req)
        begun = self.store.begin(job, step, str(req["manifest"]), holder_for, owner)
        if isinstance(begun, Held):  # its source restarted and sent it again
            conn.sendall(b"HD" + struct.pack("<Q", begun.size))
            return
        incoming = begun
        try:
            conn.sendall(b"GO")
            conn.settimeout(self.idle)
            left = sum(r.size for r in incoming.manifest.ranks)
            view = memoryview(bytearray(CHUNK))
            while left:
                n = conn.recv_into(view, min(len(view), left))
                if n == 0:
                    raise OSError(f"the sender closed with {left} bytes of the replica to come")
                incoming.write(view[:n])
                left -= n
            held = incoming.finish()
        except BaseException as exc:
            incoming.abort()  # its budget reservation with it
            if isinstance(exc, TimeoutError):
                log.warning("a replica of %s from a silent sender dropped", job)
                exc = Unavailable(
                    f"no replica bytes for {self.idle:g} s (peer_idle_seconds): dropped"
                )
            if isinstance(exc, CkptdError):  # refused mid-stream (a crc, a size)
                _refuse(conn, str(exc))
                return
            raise
        with self._lock:
            self.received_bytes += held.size
        log.info("replica of %s/%d from %s held (%d bytes)", job, held.step, held.source, held.size)
        conn.sendall(b"OK" + struct.pack("<Q", held.size))


def _refuse(conn: socket.socket, reason: str) -> None:
    try:
        data = reason.encode()[:4096]
        conn.sendall(b"ER" + struct.pack("<I", len(data)) + data)
        conn.close()
    except OSError:
        pass


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = conn.recv(n - len(out))
        if not got:
            raise OSError("the connection closed early")
        out += got
    return bytes(out)
