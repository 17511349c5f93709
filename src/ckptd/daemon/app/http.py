"""The daemon's HTTP endpoint: ``/metrics`` (Prometheus), ``/healthz`` and ``/readyz``.

A few lines of HTTP/1.1 on the daemon's own event loop (no extra thread, no web
framework): one GET per connection, answered and closed. Because it runs on the
loop that serves every RPC, ``/healthz`` answering proves the loop is not stuck;
``/readyz`` is 200 only while the daemon takes requests (not while it recovers at
start-up or finishes acknowledged work on its way out), so a Kubernetes probe
routes trainers to it only then. Binds 127.0.0.1 unless configured otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger("ckptd.http")

MAX_REQUEST_BYTES = 8192
"""A request line and headers longer than this are refused (no body is ever read)."""
READ_TIMEOUT_SECONDS = 10.0


def parse_address(text: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (``[V6]:PORT``) -> ``(host, port)``; ``off`` or empty -> None.
    Raises ValueError saying what is accepted."""
    text = text.strip()
    if text.lower() in ("", "off", "none", "false"):
        return None
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:9464, or off)")
    return host, int(port)


class HealthServer:
    """Serves the three endpoints until :meth:`stop`."""

    def __init__(
        self,
        metrics: Callable[[], bytes],
        healthy: Callable[[], str],
    ) -> None:
        self._metrics = metrics
        self._healthy = healthy
        self._ready = False
        self._server: asyncio.Server | None = None
        self.address = ""
        """``host:port`` actually bound (the port chosen when 0 was asked for)."""

    def set_ready(self, ready: bool) -> None:
        """``serve`` says the gRPC socket takes requests (True), or stop began (False)."""
        self._ready = ready

    async def start(self, host: str, port: int) -> None:
        """Listen (raises OSError if the address cannot be bound)."""
        self._server = await asyncio.start_server(self._answer, host, port, limit=MAX_REQUEST_BYTES)
        sock = self._server.sockets[0].getsockname()
        bound = f"[{sock[0]}]" if ":" in sock[0] else sock[0]
        self.address = f"{bound}:{sock[1]}"

    async def stop(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method = "GET"
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_SECONDS)
            method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            status, ctype, body = self._route(method, path)
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, TimeoutError, ValueError):
            status, ctype, body = "400 Bad Request", "text/plain", b"bad request\n"
        except Exception as exc:  # a scrape must never take the daemon down
            log.exception("answering an HTTP request failed")
            status, ctype, body = "500 Internal Server Error", "text/plain", f"{exc}\n".encode()
        head_out = (
            f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        with contextlib.suppress(ConnectionError):
            writer.write(head_out + (b"" if method == "HEAD" else body))
            await writer.drain()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()

    def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"only GET\n"
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, self._metrics()
        if path == "/healthz":
            problem = self._healthy()
            if problem:
                return "503 Service Unavailable", "text/plain", f"unhealthy: {problem}\n".encode()
            return "200 OK", "text/plain", b"ok\n"
        if path == "/readyz":
            if self._ready:
                return "200 OK", "text/plain", b"ready\n"
            return "503 Service Unavailable", "text/plain", b"not ready: starting or stopping\n"
        return "404 Not Found", "text/plain", b"try /metrics, /healthz or /readyz\n"
