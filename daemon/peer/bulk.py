"""Replica bytes over plain TCP: a node restoring reads byte ranges of replica files
with ``sendfile`` on the serving side and ``recv_into`` a reused buffer on its own.

Why not the Peer gRPC service: Python gRPC moves ~0.3 GB/s per process on this kind
of host whatever the message size or the number of streams (every chunk is copied
into a message and out of it, under the interpreter lock), where a socket fed by
``sendfile`` and drained by ``recv_into`` moves ~1 GB/s here and needs no CPU on the
sender. gRPC keeps the control: ``Hello`` tells a peer this listener's port
(``data_port``); a daemon that gives none is read with ``GetReplicaFile``.

The protocol (one request per connection):

- request: :data:`MAGIC`, a 4-byte little-endian length, that many bytes of JSON
  ``{"token", "job", "source", "step", "file", "offset", "length"}``
  (at most :data:`MAX_REQUEST` bytes, within :data:`REQUEST_SECONDS`);
- answer: ``OK`` and an 8-byte length, then exactly that many bytes of the file
  from ``offset``; or ``ER``, a 4-byte length and a UTF-8 reason.

The token is compared in constant time before anything else of the request is
used; names and the file are checked by the replica store (a file is served only
if a replica held here lists it), as for ``GetReplicaFile``.
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
from collections.abc import Callable
from typing import Any

import google_crc32c
import numpy as np

from ckptd.core.errors import (
    CkptdError,
    DataLoss,
    InvalidArgument,
    Unauthenticated,
    Unavailable,
)
from ckptd.core.names import check_name, check_step

from .. import faults
from .link import CHUNK
from .replicas import ReplicaStore

log = logging.getLogger("ckptd.peer")

MAGIC = b"CKPTDPD1"
MAX_REQUEST = 4096
REQUEST_SECONDS = 10.0
"""How long a client may take to send its request (then it is dropped)."""
IDLE_SECONDS = 60.0
"""How long either side waits on a silent peer mid-transfer."""
SEND_CHUNK = 8 * 2**20
"""Bytes per ``sendfile`` call (the failpoint between calls: tests)."""
MAX_CONNECTIONS = 32


class BulkServer:
    """Serves ranges of the replica files held here to the daemons holding the token,
    one thread per connection (``sendfile`` runs outside the interpreter lock)."""

    def __init__(self, store: ReplicaStore, token: str) -> None:
        self.store, self._token = store, token.encode()
        self._sock: socket.socket | None = None
        self._open = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self.served_bytes = 0
        """Bytes of replica files sent (metrics)."""
        self.port = 0

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
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed: the daemon stops
            if not self._open.acquire(blocking=False):
                _refuse(conn, "too many transfers at once; try again")
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(REQUEST_SECONDS)
                try:
                    path, offset, length = self._request(conn)
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                except (CkptdError, OSError, ValueError) as exc:
                    _refuse(conn, str(exc))
                    return
                try:
                    conn.settimeout(IDLE_SECONDS)
                    self._send(conn, fd, offset, length)
                finally:
                    os.close(fd)
        except OSError as exc:  # the reader went away: its fetch tries another holder
            log.info("peer transfer ended early: %s", exc)
        finally:
            self._open.release()

    def _request(self, conn: socket.socket) -> tuple[str, int, int]:
        head = _recv_exact(conn, len(MAGIC) + 4)
        if head[: len(MAGIC)] != MAGIC:
            raise InvalidArgument("not a ckptd peer data request")
        (size,) = struct.unpack("<I", head[len(MAGIC) :])
        if size > MAX_REQUEST:
            raise InvalidArgument(f"request of {size} bytes (at most {MAX_REQUEST})")
        req = json.loads(_recv_exact(conn, size))
        if not isinstance(req, dict) or not hmac.compare_digest(
            str(req.get("token", "")).encode(), self._token
        ):
            raise Unauthenticated(
                "peer data request without the shared token: give every daemon the "
                "same peer_token_file"
            )
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
        while offset < end:
            sent = conn.sendfile(file, offset, min(most, end - offset))
            if sent == 0:
                raise OSError("the replica file shrank while it was sent")
            offset += sent
            with self._lock:
                self.served_bytes += sent
            if faults.armed("peer.serve_chunk"):  # tests: a peer dying mid-transfer
                faults.hit("peer.serve_chunk")


def _refuse(conn: socket.socket, reason: str) -> None:
    try:
        data = reason.encode()[:MAX_REQUEST]
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


def read_range(
    address: tuple[str, int],
    request: dict[str, Any],
    buf: memoryview,
    sink: Callable[[memoryview], None],
) -> int:
    """Read ``request["length"]`` bytes of a replica file from the bulk listener at
    ``address`` through ``buf``, handing each piece to ``sink`` in order; their crc32c
    is returned. Raises :class:`Unavailable` (unreachable, refused, cut short)."""
    body = json.dumps(request).encode()
    view = np.frombuffer(buf, np.uint8)  # google-crc32c reads numpy views in place
    try:
        with socket.create_connection(address, timeout=IDLE_SECONDS) as conn:
            conn.sendall(MAGIC + struct.pack("<I", len(body)) + body)
            head = _recv_exact(conn, 2)
            if head == b"ER":
                (size,) = struct.unpack("<I", _recv_exact(conn, 4))
                raise Unavailable(_recv_exact(conn, size).decode(errors="replace"))
            if head != b"OK":
                raise DataLoss("the peer answered outside the data protocol")
            (length,) = struct.unpack("<Q", _recv_exact(conn, 8))
            if length != request["length"]:
                raise DataLoss(f"the peer offered {length} bytes, not {request['length']}")
            crc, got = 0, 0
            while got < length:
                n = conn.recv_into(buf, min(len(buf), length - got))
                if n == 0:
                    raise Unavailable(f"the peer closed after {got} of {length} bytes")
                sink(buf[:n])
                crc = int(google_crc32c.extend(crc, view[:n]))
                got += n
            return crc
    except OSError as exc:
        raise Unavailable(f"peer data connection to {address[0]}:{address[1]}: {exc}") from None
