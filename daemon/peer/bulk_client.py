"""The calling side of the bulk listener (bulk.py): ranged reads of a replica file
for a restore, and the push of a replica by its source."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import google_crc32c
import numpy as np

from ckptd.core.errors import DataLoss, Unavailable

from .bulk import IDLE_SECONDS, request_frame

CONNECT_SECONDS = 10.0
HELD_SECONDS = 900.0
"""How long a pusher waits for the receiver to sync and commit the replica."""


def read_range(
    address: tuple[str, int],
    token: str,
    request: dict[str, Any],
    buf: memoryview,
    sink: Callable[[memoryview], None],
) -> int:
    """Read ``request["length"]`` bytes of a replica file from the bulk listener at
    ``address`` through ``buf``, handing each piece to ``sink`` in order; their crc32c
    is returned. Raises :class:`Unavailable` (unreachable, refused, cut short)."""
    view = np.frombuffer(buf, np.uint8)  # google-crc32c reads numpy views in place
    try:
        with socket.create_connection(address, timeout=IDLE_SECONDS) as conn:
            conn.sendall(request_frame(token, {**request, "op": "get"}))
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


async def push(
    address: tuple[str, int],
    token: str,
    request: dict[str, Any],
    pieces: Callable[[], AsyncIterator[memoryview]],
) -> int:
    """Push a replica (``request``: job, step, manifest) and its files' bytes from
    ``pieces()`` (not called if the peer holds it already); the size the peer holds.
    Raises :class:`Unavailable` (unreachable, refused, cut short)."""
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, address), CONNECT_SECONDS)
        await loop.sock_sendall(sock, request_frame(token, {**request, "op": "put"}))
        head = await _answer(loop, sock, CONNECT_SECONDS)
        if head is not None:
            return head  # held already
        async for piece in pieces():
            await loop.sock_sendall(sock, piece)
        sock.shutdown(socket.SHUT_WR)  # all sent: a receiver missing bytes sees the end
        held = await _answer(loop, sock, HELD_SECONDS)
        if held is None:
            raise DataLoss("the peer answered outside the data protocol")
        return held
    except (OSError, TimeoutError) as exc:
        raise Unavailable(f"peer data connection to {address[0]}:{address[1]}: {exc}") from None
    finally:
        sock.close()


async def _answer(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, timeout: float
) -> int | None:
    """``OK``/``HD`` and a size: the size; ``GO``: None; ``ER``: Unavailable."""
    head = await asyncio.wait_for(_arecv_exact(loop, sock, 2), timeout)
    if head in (b"OK", b"HD"):
        (size,) = struct.unpack("<Q", await _arecv_exact(loop, sock, 8))
        return int(size)
    if head == b"GO":
        return None
    if head == b"ER":
        (n,) = struct.unpack("<I", await _arecv_exact(loop, sock, 4))
        raise Unavailable((await _arecv_exact(loop, sock, n)).decode(errors="replace"))
    raise DataLoss("the peer answered outside the data protocol")


async def _arecv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = await loop.sock_recv(sock, n - len(out))
        if not got:
            raise OSError("the connection closed early")
        out += got
    return bytes(out)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = conn.recv(n - len(out))
        if not got:
            raise OSError("the connection closed early")
        out += got
    return bytes(out)
