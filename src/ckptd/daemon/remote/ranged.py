"""Downloads off the event loop: parallel ranged GETs in worker threads, straight into place.

A restore from the bucket moves the whole checkpoint through the daemon. Through the
fsspec libraries every byte crosses the event loop several times (aiohttp's buffers,
botocore's streaming body, a copy into place) beside per-request Python (signing,
response parsing), and the loop's one core becomes the limit: profiled on a 1 GiB
restore from SeaweedFS, the loop held the GIL ~90% of the time. Here each part of an
object is one plain HTTP(S) GET with a ``Range`` header, issued from a worker thread on
a kept-alive connection. The socket is read with ``recv_into`` straight into the part's
place in the destination memory (a restore lease, or a pooled buffer); each chunk is
checksummed as it lands (crc32c in C, GIL released) and written to the file with
``O_DIRECT``, so network, checksum and disk overlap within a part and across parts. The
event loop only hands out parts and combines their crc32c.

The backend says how to reach an object (:meth:`Remote.range_source`): S3 a URL
presigned for each part (whatever credentials the provider chain gives), GCS its media
link with the bearer header gcsfs would send. Without one (``file://``; or an HTTP
proxy set in the environment, which plain ``http.client`` would not honour) downloads
go through the fsspec library as before.

A part that fails on a transient error (a reset connection, a timeout, a 5xx) resumes
where its last whole chunk ended, on a new connection, up to :data:`ATTEMPTS` times.
Any other failure stops the sibling parts (their sockets are shut down, so even a
blocked read returns at once) before the error reaches the caller, and the caller's
memory is given back only once no thread writes into it (:func:`..io.gather_all`).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np

from ckptd.core import checksum
from ckptd.core.format import round_up

from .. import faults
from ..io import gather_all
from .buffers import BufferPool

CHUNK = 4 * 2**20
"""Bytes read, checksummed and written at a time within a part (a multiple of 4 KiB)."""
ATTEMPTS = 3
"""Tries per part on transient errors (each resumes after the last whole chunk)."""
READ_TIMEOUT_SECONDS = 60.0
"""A socket that delivers nothing for this long counts as a transient failure."""
SOURCE_MAX_AGE_SECONDS = 300.0
"""Parts starting later than this into a download get a fresh :class:`RangeSource`
(S3 URLs are presigned for an hour; GCS tokens are refreshed before they expire)."""
_ERROR_BODY_MAX = 4096
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")

_fault_lock = threading.Lock()  # a "pause" failpoint is taken by one thread only

Populate = Callable[[int, int], None]
"""``populate(offset, length)``: allocate the pages of that range of the destination
memory before it is written (a restore segment made without them: see
:meth:`ckptd.daemon.local.lease.Segment.populate`); raises OSError if it cannot."""


class RangeError(Exception):
    """A ranged GET failed; ``transient``: worth another try. ``status``: the HTTP status."""

    def __init__(self, message: str, transient: bool, status: int = 0) -> None:
        super().__init__(message)
        self.transient = transient
        self.status = status


@dataclass(frozen=True)
class RangeSource:
    """How a worker thread reads byte ranges of one object: a URL and its headers."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)


def proxy_configured() -> bool:
    """Whether the environment routes HTTP(S) through a proxy (plain sockets would not)."""
    return any(os.environ.get(v) for v in _PROXY_VARIABLES)


class Transfer:
    """One object's download in flight: the file its parts go to, and a way to stop them
    all (a failed part sets it; so does the caller's cancellation)."""

    def __init__(self, key: str, fd: int, direct: bool) -> None:
        self.key = key
        self.fd = fd
        self.direct = direct
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        """The first part's failure: what the caller hears (not a sibling's "stopped")."""
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()

    def stop(self, error: BaseException | None = None) -> None:
        """Stop every part: set the flag, and shut the sockets down under blocked reads.
        ``error``: the failure that stops them (only the first is kept)."""
        with self._lock:
            if error is not None and self.error is None and not self.stopped.is_set():
                self.error = error
        self.stopped.set()
        with self._lock:
            socks = list(self._socks)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def watch(self, sock: socket.socket | None, on: bool) -> None:
        """Register (``on``) or forget the socket a part is reading from."""
        if sock is None:
            return
        with self._lock:
            if on:
                self._socks.add(sock)
            else:
                self._socks.discard(sock)
        if on and self.stopped.is_set():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def check(self) -> None:
        """Raise if the transfer was stopped (a sibling failed or the caller gave up)."""
        if self.stopped.is_set():
            raise RangeError(f"{self.key}: download stopped", transient=False)


class RangeReader:
    """Worker threads issuing ranged GETs, each with its own kept-alive connections."""

    def __init__(self, threads: int, ssl_context: Callable[[], ssl.SSLContext]) -> None:
        self._pool = ThreadPoolExecutor(max(1, threads), "ckptd-fetch")
        self._local = threading.local()
        self._make_ssl = ssl_context
        self._ssl: ssl.SSLContext | None = None  # made at the first https URL (loads CAs)
        self._all: list[http.client.HTTPConnection] = []
        self._all_lock = threading.Lock()
        self.parts_read = 0
        """Parts read to the end (for status and tests)."""
        self.parts_resumed = 0
        """Retries that went on from a part's last whole chunk rather than its start."""

    def close(self) -> None:
        """Stop the threads (no transfer may be in flight) and close their connections."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._all_lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()

    async def download(
        self,
        transfer: Transfer,
        pieces: list[tuple[int, int]],
        into: memoryview | None,
        source: RangeSource,
        fresh: Callable[[str], Awaitable[RangeSource | None]],
        buffers: BufferPool,
        populate: Populate | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[int]:
        """Every ``(offset, length)`` part of one object into its file (and ``into``, the
        whole object's memory, if given, each chunk's pages allocated with ``populate``
        just before it lands; else each part through a pooled buffer); returns the
        parts' crc32c, calling ``progress(n)`` as each part of ``n`` bytes is in. Parts
        run in submission order on the threads, so the files of a step finish one after
        another, each as early as it can."""
        loop = asyncio.get_running_loop()
        made = loop.time()

        async def one(offset: int, length: int) -> int:
            nonlocal source, made
            if loop.time() - made > SOURCE_MAX_AGE_SECONDS:
                source, made = await fresh(transfer.key) or source, loop.time()
            if into is not None:
                crc = await self.part(transfer, source, offset, length, into, offset, populate)
            else:
                async with buffers.buffer() as buf:
                    crc = await self.part(transfer, source, offset, length, memoryview(buf), 0)
            if progress is not None:
                progress(length)  # on the loop: callers need no lock
            return crc

        try:
            # A failed part stops its siblings before the memory (a lease) is given back.
            return await gather_all(*(one(o, n) for o, n in pieces))
        except Exception:
            if transfer.error is not None:
                raise transfer.error from None
            raise

    async def part(
        self,
        transfer: Transfer,
        source: RangeSource,
        offset: int,
        length: int,
        dst: memoryview,
        start: int,
        populate: Populate | None = None,
    ) -> int:
        """Read ``length`` bytes at ``offset`` into ``dst[start:]`` and the file at
        ``offset``, on a worker thread; returns their crc32c. Cancelled, it stops the
        transfer and returns (raising) only once the thread no longer touches ``dst``."""
        cf = self._pool.submit(self._part, transfer, source, offset, length, dst, start, populate)
        waiter = asyncio.wrap_future(cf)
        try:
            return await asyncio.shield(waiter)
        except asyncio.CancelledError:
            transfer.stop()
            cf.cancel()
            while not cf.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([waiter])
            raise

    # -- on a worker thread ----------------------------------------------------------
    def _part(
        self,
        transfer: Transfer,
        source: RangeSource,
        offset: int,
        length: int,
        dst: memoryview,
        start: int,
        populate: Populate | None,
    ) -> int:
        try:
            faults.hit("fetch.part")
            done = _Progress(np.frombuffer(dst, np.uint8))
            tries = 0
            while True:
                transfer.check()
                try:
                    self._read(transfer, source, offset, length, dst, start, done, populate)
                    with self._all_lock:
                        self.parts_read += 1
                    return done.crc
                except RangeError as exc:
                    tries += 1
                    if not exc.transient or tries >= ATTEMPTS or transfer.stopped.is_set():
                        raise
                    if done.pos:
                        with self._all_lock:
                            self.parts_resumed += 1
        except BaseException as exc:
            transfer.stop(exc)
            raise

    def _read(
        self,
        transfer: Transfer,
        source: RangeSource,
        offset: int,
        length: int,
        dst: memoryview,
        start: int,
        done: _Progress,
        populate: Populate | None,
    ) -> None:
        """One GET of the part from ``done.pos`` on; ``done`` advances chunk by chunk, so
        after a failure it holds the last whole chunk's end (where a retry resumes)."""
        conn = self._conn(source.url)
        resp = self._get(conn, transfer, source, offset + done.pos, length - done.pos)
        sock = conn.sock
        try:
            while done.pos < length:
                transfer.check()
                pos = done.pos
                n = min(CHUNK, length - pos)
                if populate is not None:
                    try:
                        populate(start + pos, round_up(n))
                    except OSError as exc:
                        raise RangeError(
                            f"{transfer.key}: no shared memory left for the download "
                            f"({exc.strerror}); free space in /dev/shm or lower "
                            "staging_budget_bytes",
                            transient=False,
                        ) from None
                view = dst[start + pos : start + pos + n]
                got = 0
                while got < n:
                    k = resp.readinto(view[got:])
                    if not k:
                        raise RangeError(
                            f"{transfer.key}: the store ended the response at byte "
                            f"{offset + pos + got}",
                            transient=True,
                        )
                    got += k
                crc = checksum.extend(done.crc, done.flat[start + pos : start + pos + n])
                self._write(transfer, dst, start + pos, n, offset + pos)
                done.crc, done.pos = crc, pos + n
                if done.pos < length and faults.armed("fetch.chunk"):
                    with _fault_lock:
                        faults.hit("fetch.chunk")
        except RangeError:
            conn.close()
            raise
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            if transfer.stopped.is_set():
                transfer.check()
            raise RangeError(f"{transfer.key}: {type(exc).__name__}: {exc}", True) from None
        finally:
            transfer.watch(sock, False)

    def _get(
        self,
        conn: http.client.HTTPConnection,
        transfer: Transfer,
        source: RangeSource,
        start: int,
        length: int,
    ) -> http.client.HTTPResponse:
        parts = urlsplit(source.url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        headers = {
            **source.headers,
            "Range": f"bytes={start}-{start + length - 1}",
            "Accept-Encoding": "identity",
        }
        sock = None
        try:
            if conn.sock is None:
                conn.connect()
            sock = conn.sock
            transfer.watch(sock, True)
            conn.request("GET", target, headers=headers)
            resp = conn.getresponse()
            if resp.status != 206 or resp.length != length:
                body = resp.read(_ERROR_BODY_MAX) if resp.status != 206 else b""
                raise _status_error(transfer.key, resp.status, resp.length, length, body)
        except (OSError, http.client.HTTPException) as exc:
            transfer.watch(sock, False)
            conn.close()
            if isinstance(exc, FileNotFoundError):
                raise
            transfer.check()  # stopped: its own error, not the shut-down socket's
            raise RangeError(f"{transfer.key}: {type(exc).__name__}: {exc}", True) from None
        except BaseException:
            transfer.watch(sock, False)
            conn.close()
            raise
        return resp

    def _write(self, transfer: Transfer, src: memoryview, start: int, n: int, at: int) -> None:
        """``src[start:start+n]`` to the file at ``at``; with O_DIRECT padded to a whole
        block (only a file's last chunk is not one; the file is truncated afterwards)."""
        view = src[start : start + (round_up(n) if transfer.direct else n)]
        while len(view):
            done = os.pwrite(transfer.fd, view, at)
            view, at = view[done:], at + done

    def _conn(self, url: str) -> http.client.HTTPConnection:
        """This thread's kept-alive connection to the URL's host."""
        parts = urlsplit(url)
        conns: dict[tuple[str, str], http.client.HTTPConnection] = (
            getattr(self._local, "conns", None) or {}
        )
        self._local.conns = conns
        key = (parts.scheme, parts.netloc)
        conn = conns.get(key)
        if conn is None:
            host, port = parts.hostname or "", parts.port
            if parts.scheme == "https":
                with self._all_lock:
                    if self._ssl is None:
                        self._ssl = self._make_ssl()
                conn = http.client.HTTPSConnection(
                    host, port, timeout=READ_TIMEOUT_SECONDS, context=self._ssl
                )
            else:
                conn = http.client.HTTPConnection(host, port, timeout=READ_TIMEOUT_SECONDS)
            conns[key] = conn
            with self._all_lock:
                self._all.append(conn)
        return conn


@dataclass
class _Progress:
    """How far a part got: its bytes up to ``pos`` are in place, with crc32c ``crc``."""

    flat: np.ndarray
    crc: int = 0
    pos: int = 0


def _status_error(key: str, status: int, got: int | None, want: int, body: bytes) -> Exception:
    if status == 206:
        return RangeError(f"{key}: the store sent {got} bytes for a {want}-byte range", True)
    if status == 404:
        return FileNotFoundError(key)
    text = body.decode("utf-8", "replace").strip()[:300]
    transient = status >= 500 or status in (408, 429)
    return RangeError(f"{key}: HTTP {status} for a ranged GET: {text}", transient, status)
