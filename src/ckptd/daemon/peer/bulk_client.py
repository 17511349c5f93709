"""The calling side of the bulk listener (bulk.py): ranged reads of a replica file
for a restore, and the push of a replica by its source."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import google_crc32c
import numpy as np

from ckptd.core.errors import DataLoss, Unavailable

from .bulk import IDLE_SECONDS, request_frame
from .tls import PeerTls

CONNECT_SECONDS = 10.0
HELD_SECONDS = 900.0
"""How long a pusher waits for the receiver to sync and commit the replica."""


def read_range(
    address: tuple[str, int],
    token: str,
    request: dict[str, Any],
    buf: memoryview,
    sink: Callable[[memoryview], None],
    tls: PeerTls | None = None,
    name: str = "",
) -> int:
    """Read ``request["length"]`` bytes of a replica file from the bulk listener at
    ``address`` through ``buf``, handing each piece to ``sink`` in order; their crc32c
    is returned. With ``tls``, the peer's certificate must hold ``name`` (its ``peers``
    host; empty: the address's). Raises :class:`Unavailable` (unreachable, refused,
    cut short)."""
    view = np.frombuffer(buf, np.uint8)  # google-crc32c reads numpy views in place
    try:
        with contextlib.ExitStack() as stack:
            conn = stack.enter_context(socket.create_connection(address, timeout=IDLE_SECONDS))
            if tls is not None:
                conn = stack.enter_context(
                    tls.client_context().wrap_socket(
                        conn, server_hostname=tls.hostname(name or address[0])
                    )
                )
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
                # Each piece on as it comes, not a full buffer first: the write then
                # overlaps the next bytes arriving (measured: a 1 GiB fetch took
                # 1.5 s this way, 2.0 s filling 4 MiB before each write).
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
    total: int,
    tls: PeerTls | None = None,
    name: str = "",
) -> int:
    """Push a replica (``request``: job, step, manifest) and its files' ``total`` bytes
    from ``pieces()`` (not called if the peer holds it already); the size the peer
    holds. Raises :class:`Unavailable` (unreachable, refused, cut short)."""
    try:
        if tls is not None:
            counted = _counted(pieces, total)
            return await _push_tls(address, token, request, counted, tls, name or address[0])
        return await _push_plain(address, token, request, _counted(pieces, total))
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
        raise Unavailable(f"peer data connection to {address[0]}:{address[1]}: {exc}") from None


def _counted(
    pieces: Callable[[], AsyncIterator[memoryview]], total: int
) -> Callable[[], AsyncIterator[memoryview]]:
    """``pieces`` raising if they come to other than ``total`` bytes: the connection
    then closes and the receiver drops the replica, instead of both sides waiting."""

    async def counted() -> AsyncIterator[memoryview]:
        sent = 0
        async for piece in pieces():
            sent += len(piece)
            if sent > total:
                break
            yield piece
        if sent != total:
            raise OSError(f"the replica's files came to {sent} bytes, not {total}")

    return counted


async def _push_plain(
    address: tuple[str, int],
    token: str,
    request: dict[str, Any],
    pieces: Callable[[], AsyncIterator[memoryview]],
) -> int:
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)

    def recv(n: int) -> Awaitable[bytes]:
        return _arecv_exact(loop, sock, n)

    try:
        await asyncio.wait_for(loop.sock_connect(sock, address), CONNECT_SECONDS)
        await loop.sock_sendall(sock, request_frame(token, {**request, "op": "put"}))
        head = await _answer(recv, CONNECT_SECONDS)
        if head is not None:
            return head  # held already
        async for piece in pieces():
            # From the reader's buffer: no copy. Bounded: a receiver that stops reading
            # (frozen, its disk stuck) must not stall replication for good.
            await asyncio.wait_for(loop.sock_sendall(sock, piece), HELD_SECONDS)
        sock.shutdown(socket.SHUT_WR)  # all sent: the receiver reads to the end
        return await _held(recv)
    finally:
        sock.close()


async def _push_tls(
    address: tuple[str, int],
    token: str,
    request: dict[str, Any],
    pieces: Callable[[], AsyncIterator[memoryview]],
    tls: PeerTls,
    name: str,
) -> int:
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(
            address[0],
            address[1],
            ssl=tls.client_context(),
            server_hostname=tls.hostname(name),
        ),
        CONNECT_SECONDS,
    )
    try:
        writer.write(request_frame(token, {**request, "op": "put"}))
        await writer.drain()
        head = await _answer(reader.readexactly, CONNECT_SECONDS)
        if head is not None:
            return head  # held already
        async for piece in pieces():
            # Copied: the transport may hold what it is given past drain(), and the
            # reader's buffer is refilled once the next piece is asked for.
            writer.write(bytes(piece))
            await asyncio.wait_for(writer.drain(), HELD_SECONDS)
        # No half-close over TLS (asyncio): the receiver counts the bytes the manifest
        # names, and a sender coming short closes instead (_counted).
        return await _held(reader.readexactly)
    finally:
        writer.close()
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), CONNECT_SECONDS)


async def _held(recv: Callable[[int], Awaitable[bytes]]) -> int:
    """The receiver's answer once it has synced and committed the replica."""
    held = await _answer(recv, HELD_SECONDS)
    if held is None:
        raise DataLoss("the peer answered outside the data protocol")
    return held


async def _answer(recv: Callable[[int], Awaitable[bytes]], timeout: float) -> int | None:
    """``OK``/``HD`` and a size: the size; ``GO``: None; ``ER``: Unavailable."""
    head = await asyncio.wait_for(recv(2), timeout)
    if head in (b"OK", b"HD"):
        (size,) = struct.unpack("<Q", await recv(8))
        return int(size)
    if head == b"GO":
        return None
    if head == b"ER":
        (n,) = struct.unpack("<I", await recv(4))
        raise Unavailable((await recv(n)).decode(errors="replace"))
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
