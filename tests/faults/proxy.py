"""A fault-injecting TCP proxy for tests: put it between the daemon and a store.

:class:`FaultProxy` listens on 127.0.0.1 and forwards each connection to an upstream.
Its asyncio loop runs in a background thread so synchronous tests can drive it;
:meth:`FaultProxy.set_mode` returns once the new mode holds for every connection::

    with FaultProxy(("127.0.0.1", s3.s3_port)) as proxy:     # s3: tests.servers.SeaweedS3
        env = {**s3.env(), "AWS_ENDPOINT_URL_S3": proxy.url}
        proxy.set_mode("http_error", status=503)   # the store throttles
        proxy.set_mode("freeze")                   # the store hangs
        proxy.set_mode("pass")                     # the store recovers

Modes (parameters in brackets):

- ``pass``: forward bytes both ways unchanged.
- ``reset``: reset (RST, the client sees ECONNRESET) existing and new connections.
- ``refuse``: stop listening (connects are refused) and reset existing connections.
- ``freeze``: accept and read, never forward or answer: a hung store. Leaving freeze
  resets frozen connections instead of resuming them: each may have swallowed part of a
  request, and the rest must not reach the upstream as garbage.
- ``http_error`` [``status=503``, ``body``]: answer each new HTTP request with ``status``,
  an S3-style XML body whose error code matches the status (403 AccessDenied, 503
  SlowDown, ...; none for a HEAD, as HTTP requires) and ``Connection: close``, never
  reaching the upstream. On an open keep-alive connection a client chunk starting with
  an HTTP method is a new request.
- ``slow`` [``delay`` seconds per chunk, ``bytes_per_second``]: forward, late and/or
  capped (per connection and direction).
- ``flaky`` [``every=2``]: every N-th connection accepted since the mode was set is
  reset, the others pass. Counter-based, so a test knows which attempt fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import re
import socket
import struct
import threading
from collections.abc import Coroutine
from typing import Any, Literal, Self, TypeVar, get_args

Mode = Literal["pass", "reset", "refuse", "freeze", "http_error", "slow", "flaky"]

LOOPBACK = "127.0.0.1"
ERROR_CODES = {
    400: "InvalidRequest",
    403: "AccessDenied",
    404: "NoSuchKey",
    408: "RequestTimeout",
    429: "SlowDown",
    500: "InternalError",
    503: "SlowDown",
}
"""The S3 error code a real store sends with each status: a client reads the code from
the body first, so a 403 saying SlowDown would be retried as throttling."""

_CHUNK = 64 * 1024
_HEAD_LIMIT = 64 * 1024
_CALL_TIMEOUT_S = 10.0
_LINGER_S = 5.0
"""How long an injected error reply waits for the client to hang up before closing."""
_SLICE_S = 0.01
"""Granularity of the bandwidth cap: one write per this many seconds' worth of bytes."""
# The parameters each mode accepts; the other modes take none.
_PARAMS = {
    "http_error": {"status", "body"},
    "slow": {"delay", "bytes_per_second"},
    "flaky": {"every"},
}
_REQUEST_START = re.compile(rb"(?:GET|HEAD|PUT|POST|DELETE|PATCH|OPTIONS) \S")
_T = TypeVar("_T")


class _Conn:
    """One accepted client connection and, once dialled, its upstream connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.client_r = reader
        self.client_w = writer
        self.up_r: asyncio.StreamReader | None = None
        self.up_w: asyncio.StreamWriter | None = None
        # "pass" forwards; "frozen" and "hijacked" (answering an injected error) swallow
        # what they read; "closed" is final.
        self.state = "pass"
        self.task = asyncio.current_task()

    def reset(self) -> None:
        """Abort both sides; SO_LINGER 0 makes the client see an RST, not a clean FIN."""
        self.state = "closed"
        sock = self.client_w.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.client_w.transport.abort()
        if self.up_w is not None:
            self.up_w.transport.abort()

    def close(self) -> None:
        """Close both sides (a no-op for a side already aborted)."""
        self.state = "closed"
        self.client_w.close()
        if self.up_w is not None:
            self.up_w.close()


class FaultProxy:
    """A TCP proxy on 127.0.0.1 to ``upstream`` whose behaviour a test switches at will.

    Counters (plain ints, written only by the proxy's thread): ``connections`` accepted,
    ``requests_failed`` (connections reset by ``reset``/``refuse``/``flaky`` plus error
    replies injected by ``http_error``), ``bytes_up`` (forwarded to the upstream) and
    ``bytes_down`` (forwarded to clients). Each is updated before the bytes or the reply
    it counts leave the proxy, so a client that has seen them can assert on the counter.
    ``connected`` is set on every accept: clear it, act, then ``connected.wait(timeout)``
    to know the client reached the proxy.
    """

    def __init__(self, upstream: tuple[str, int], *, port: int = 0) -> None:
        self.upstream = upstream
        self.port = port
        self.connections = self.requests_failed = self.bytes_up = self.bytes_down = 0
        self.connected = threading.Event()
        self._mode: tuple[str, dict[str, Any]] = ("pass", {})
        self._flaky_seen = 0
        self._conns: set[_Conn] = set()
        self._sock: socket.socket | None = None
        self._shut = False
        """The listener is shut down for reading (refusing connects)."""
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, for an endpoint setting."""
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def mode(self) -> str:
        """The current mode's name."""
        return self._mode[0]

    def start(self) -> Self:
        """Bind (``port`` 0 picks a free one), start the loop thread, and listen."""
        if self._thread is not None:
            return self
        # An explicit port, never 0, so that refuse keeps it: see _stop_listening().
        self._sock = socket.create_server((LOOPBACK, self.port or _free_port()))
        self.port = self._sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"FaultProxy:{self.port}", daemon=True
        )
        self._thread.start()
        try:
            self._call(self._apply(*self._mode))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Reset every connection, stop listening and join the thread. Idempotent."""
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(_CALL_TIMEOUT_S)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def set_mode(self, mode: Mode, **params: Any) -> None:
        """Switch to ``mode`` (see the module docstring); effective when this returns."""
        _check(mode, params)
        if self._loop is None:
            self._mode = (mode, params)  # applied by start()
        else:
            self._call(self._apply(mode, params))

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_CALL_TIMEOUT_S)

    # Everything below runs on the proxy's loop thread.

    async def _apply(self, mode: str, params: dict[str, Any]) -> None:
        self._mode = (mode, params)
        self._flaky_seen = 0
        for conn in list(self._conns):
            if mode in ("reset", "refuse") and conn.state != "closed":
                conn.reset()
                self.requests_failed += 1
            elif mode == "freeze" and conn.state == "pass":
                conn.state = "frozen"
            elif mode != "freeze" and conn.state == "frozen":
                conn.reset()  # never resumed: see "freeze" in the module docstring
        if mode == "refuse":
            self._stop_listening()
        elif self._server is None:
            assert self._sock is not None
            # A duplicate, so closing the server leaves our socket (and port) bound.
            self._server = await asyncio.start_server(self._handle, sock=self._sock.dup())
            self._shut = False
        # Aborted transports close their sockets in callbacks already queued; let them run
        # so the RSTs are out before set_mode() returns.
        await asyncio.sleep(0)

    def _stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._sock is not None and not self._shut:
            # Linux: a listener shut down for reading refuses connects yet keeps its
            # explicitly bound port, so no other socket can take it before we listen again.
            # Only once: shut down a second time, the next listen accepts connections
            # that then fail.
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RD)
            self._shut = True

    async def _shutdown(self) -> None:
        self._stop_listening()
        tasks = [c.task for c in self._conns if c.task is not None]
        for task in tasks:
            task.cancel()  # each handler resets its connection
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(reader, writer)
        self._conns.add(conn)
        self.connections += 1
        self.connected.set()
        try:
            await self._serve(conn)
        except (OSError, asyncio.CancelledError):
            # Only stop() cancels us; ending normally keeps Python 3.11's stream callback
            # from logging the cancelled task as an error.
            conn.reset()
        finally:
            self._conns.discard(conn)
            conn.close()

    async def _serve(self, conn: _Conn) -> None:
        mode, params = self._mode
        if mode == "flaky":
            self._flaky_seen += 1
            mode = "reset" if self._flaky_seen % params.get("every", 2) == 0 else "pass"
        if mode in ("reset", "refuse"):  # refuse: accepted just before the listener closed
            conn.reset()
            self.requests_failed += 1
        elif mode == "freeze":
            conn.state = "frozen"
            await self._pump(conn, up=True)  # swallow until the client leaves or mode changes
        elif mode == "http_error":
            await self._answer_error(conn, b"")
        else:
            try:
                conn.up_r, conn.up_w = await asyncio.open_connection(*self.upstream)
            except OSError:
                conn.reset()  # the upstream is down: the client sees it fail, not hang
                return
            if conn.state != "closed":
                await asyncio.gather(self._pump(conn, up=True), self._pump(conn, up=False))

    async def _pump(self, conn: _Conn, *, up: bool) -> None:
        """Copy one direction until EOF, checking the mode for every chunk."""
        src = conn.client_r if up else conn.up_r
        dst = conn.up_w if up else conn.client_w
        assert src is not None
        try:
            while data := await src.read(_CHUNK):
                hijack = up and conn.state == "pass" and self._mode[0] == "http_error"
                if hijack and _REQUEST_START.match(data):
                    await self._answer_error(conn, data)
                    return
                if conn.state != "pass" or dst is None:
                    continue  # frozen or hijacked: swallow, as a hung store would
                await self._forward(conn, dst, data, up=up)
            if conn.state == "pass" and dst is not None and dst.can_write_eof():
                dst.write_eof()  # pass half-closes on, so EOF-delimited exchanges work
        except OSError:
            conn.reset()  # mirror a reset or broken side onto the other

    async def _forward(
        self, conn: _Conn, dst: asyncio.StreamWriter, data: bytes, *, up: bool
    ) -> None:
        mode, params = self._mode
        pieces = [data]
        rate = 0.0
        if mode == "slow":
            if params.get("delay"):
                await asyncio.sleep(params["delay"])
            if params.get("bytes_per_second"):
                rate = float(params["bytes_per_second"])
                step = max(1, int(rate * _SLICE_S))
                pieces = [data[i : i + step] for i in range(0, len(data), step)]
        for piece in pieces:
            if rate:
                await asyncio.sleep(len(piece) / rate)
            if conn.state != "pass":
                return  # frozen or reset while we slept
            if up:
                self.bytes_up += len(piece)
            else:
                self.bytes_down += len(piece)
            dst.write(piece)
            await dst.drain()

    async def _answer_error(self, conn: _Conn, data: bytes) -> None:
        """Read one request (head, and a Content-Length body) and answer it with an error."""
        params = self._mode[1]
        conn.state = "hijacked"
        if conn.up_w is not None:
            conn.up_w.transport.abort()  # the upstream must never see this request
        buf = bytearray(data)
        while (end := buf.find(b"\r\n\r\n")) < 0:
            more = await conn.client_r.read(_CHUNK)
            if not more or len(buf) > _HEAD_LIMIT:
                return
            buf += more
        headers = _headers(bytes(buf[:end]))
        # With "Expect: 100-continue" the client waits for us before sending its body, and a
        # chunked body has no length to wait for: answer after the head in both cases.
        if "100-continue" not in headers.get("expect", "") and "transfer-encoding" not in headers:
            length = headers.get("content-length", "")
            remaining = (int(length) if length.isdigit() else 0) - (len(buf) - end - 4)
            while remaining > 0 and (more := await conn.client_r.read(min(_CHUNK, remaining))):
                remaining -= len(more)
        status = int(params.get("status", 503))
        body = params.get("body", _error_body(status))
        body = body.encode() if isinstance(body, str) else body
        if buf.startswith(b"HEAD "):
            body = b""  # a HEAD response has no body; a client reads one as the next reply
        reason = http.client.responses.get(status, "Injected")
        self.requests_failed += 1
        conn.client_w.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await conn.client_w.drain()
        conn.client_w.write_eof()
        # Lingering close: closing with unread request bytes would send an RST, which can
        # destroy the reply before the client reads it. The client hangs up after the reply.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_LINGER_S):
                while await conn.client_r.read(_CHUNK):
                    pass


def _error_body(status: int) -> bytes:
    code = ERROR_CODES.get(status, "InternalError" if status >= 500 else "InvalidRequest")
    return f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
        return port


def _check(mode: str, params: dict[str, Any]) -> None:
    if mode not in get_args(Mode):
        raise ValueError(f"unknown mode {mode!r}; expected one of {get_args(Mode)}")
    if unknown := set(params) - _PARAMS.get(mode, set()):
        raise TypeError(f"mode {mode!r} takes no parameter(s) {sorted(unknown)}")
    every = params.get("every", 2)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"flaky every must be an int >= 1, got {every!r}")
    if params.get("delay", 0) < 0 or params.get("bytes_per_second", 1) <= 0:
        raise ValueError("slow needs delay >= 0 and bytes_per_second > 0")
    if not 100 <= int(params.get("status", 503)) <= 599:
        raise ValueError(f"http_error status must be 100-599, got {params['status']!r}")


def _headers(head: bytes) -> dict[str, str]:
    """Request header fields (names and values lowercased), the request line skipped."""
    lines = head.decode("latin-1").lower().split("\r\n")[1:]
    return {k.strip(): v.strip() for k, sep, v in (ln.partition(":") for ln in lines) if sep}
