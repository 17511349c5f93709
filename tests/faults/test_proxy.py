"""Unit tests for the fault-injecting proxy, against tiny upstreams on 127.0.0.1."""

from __future__ import annotations

import http.client
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from .proxy import LOOPBACK, FaultProxy


class _Quiet:
    """Upstreams see resets on purpose here; keep socketserver from printing tracebacks."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class _HTTPUpstream(_Quiet, ThreadingHTTPServer):
    daemon_threads = True
    hits = 0


class _HTTPHandler(BaseHTTPRequestHandler):
    """Keep-alive HTTP/1.1: GET answers b"hello", PUT echoes its body."""

    protocol_version = "HTTP/1.1"
    server: _HTTPUpstream

    def do_GET(self) -> None:
        self._reply(b"hello")

    def do_PUT(self) -> None:
        self._reply(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def _reply(self, body: bytes) -> None:
        self.server.hits += 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _EchoUpstream(_Quiet, socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class _EchoHandler(socketserver.BaseRequestHandler):
    """Echo until EOF, then close (socketserver shuts the socket down after handle())."""

    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


def _serve(server: socketserver.BaseServer) -> Iterator[Any]:
    # A short poll interval keeps shutdown() from waiting out the default 0.5 s.
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def http_upstream() -> Iterator[_HTTPUpstream]:
    yield from _serve(_HTTPUpstream((LOOPBACK, 0), _HTTPHandler))


@pytest.fixture(scope="module")
def echo_upstream() -> Iterator[_EchoUpstream]:
    yield from _serve(_EchoUpstream((LOOPBACK, 0), _EchoHandler))


@pytest.fixture
def http_proxy(http_upstream: _HTTPUpstream) -> Iterator[FaultProxy]:
    with FaultProxy(http_upstream.server_address[:2]) as proxy:  # type: ignore[arg-type]
        yield proxy


@pytest.fixture
def echo_proxy(echo_upstream: _EchoUpstream) -> Iterator[FaultProxy]:
    with FaultProxy(echo_upstream.server_address[:2]) as proxy:  # type: ignore[arg-type]
        yield proxy


def _connect(proxy: FaultProxy, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection((LOOPBACK, proxy.port), timeout=timeout)


def _echo(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data) and (chunk := sock.recv(65536)):
        got += chunk
    return got


def _request(
    proxy: FaultProxy,
    method: str = "GET",
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 5.0,
) -> tuple[int, bytes, http.client.HTTPMessage]:
    """One request on a fresh connection (http.client: no proxy settings from the env)."""
    conn = http.client.HTTPConnection(LOOPBACK, proxy.port, timeout=timeout)
    try:
        conn.request(method, "/obj", body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.headers
    finally:
        conn.close()


def test_url_port_and_idempotent_stop(echo_upstream: _EchoUpstream) -> None:
    proxy = FaultProxy(echo_upstream.server_address[:2])  # type: ignore[arg-type]
    with proxy:
        assert proxy.port > 0
        assert proxy.url == f"http://127.0.0.1:{proxy.port}"
        assert proxy.mode == "pass"
        sock = _connect(proxy)
        assert _echo(sock, b"ping") == b"ping"
    proxy.stop()  # again: a no-op
    with sock, pytest.raises(ConnectionResetError):
        sock.recv(1)  # stop() reset the open connection
    with pytest.raises(ConnectionRefusedError):
        _connect(proxy)
    with proxy, _connect(proxy) as again:  # restarts on the same port
        assert _echo(again, b"pong") == b"pong"


def test_pass_forwards_bytes_and_half_close(echo_proxy: FaultProxy) -> None:
    payload = bytes(range(256)) * 1024  # 256 KiB: more than one chunk each way
    with _connect(echo_proxy) as sock:

        def send() -> None:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)  # the echo upstream closes on EOF

        sender = threading.Thread(target=send)
        sender.start()
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
        sender.join()
    assert got == payload
    assert echo_proxy.connected.is_set()
    assert echo_proxy.connections == 1
    assert echo_proxy.bytes_up == echo_proxy.bytes_down == len(payload)
    assert echo_proxy.requests_failed == 0


def test_pass_forwards_http(http_proxy: FaultProxy) -> None:
    assert _request(http_proxy)[:2] == (200, b"hello")
    assert _request(http_proxy, "PUT", b"x" * 100_000)[:2] == (200, b"x" * 100_000)


def test_http_error_answers_without_reaching_upstream(
    http_proxy: FaultProxy, http_upstream: _HTTPUpstream
) -> None:
    hits = http_upstream.hits
    http_proxy.set_mode("http_error")
    status, body, headers = _request(http_proxy, "PUT", b"x" * 100_000)
    slow_down = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
    assert (status, body) == (503, slow_down)
    assert headers["Connection"] == "close"
    assert headers["Content-Length"] == str(len(slow_down))
    # Expect: 100-continue is answered after the head; the body sent anyway is drained.
    http_proxy.set_mode("http_error", status=500, body=b"<Error/>")
    got = _request(http_proxy, "PUT", b"y" * 100_000, {"Expect": "100-continue"})
    assert got[:2] == (500, b"<Error/>")
    assert http_proxy.requests_failed == 2
    assert http_upstream.hits == hits
    assert http_proxy.bytes_up == 0


def test_http_error_says_what_a_store_says_for_the_status(http_proxy: FaultProxy) -> None:
    # Clients read the S3 error code before the status: a 403 must say AccessDenied.
    http_proxy.set_mode("http_error", status=403)
    status, body, _ = _request(http_proxy)
    assert status == 403 and b"<Code>AccessDenied</Code>" in body
    http_proxy.set_mode("http_error", status=500)
    assert b"<Code>InternalError</Code>" in _request(http_proxy)[1]
    # A HEAD reply carries no body on the wire: a client would read it as the next reply.
    with _connect(http_proxy) as sock:
        sock.sendall(b"HEAD /obj HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 500 ") and got.endswith(
        b"Content-Length: 0\r\nConnection: close\r\n\r\n"
    )


def test_http_error_on_open_keepalive_connection(http_proxy: FaultProxy) -> None:
    conn = http.client.HTTPConnection(LOOPBACK, http_proxy.port, timeout=5)
    try:
        statuses = []
        for mode in ("pass", "http_error", "pass"):
            http_proxy.set_mode(mode)  # type: ignore[arg-type]
            conn.request("GET", "/obj")
            resp = conn.getresponse()
            resp.read()
            statuses.append(resp.status)
    finally:
        conn.close()
    assert statuses == [200, 503, 200]
    # The error reply said "Connection: close", so the last request reconnected.
    assert http_proxy.connections == 2
    assert http_proxy.requests_failed == 1


def test_reset_new_and_existing_connections(echo_proxy: FaultProxy) -> None:
    with _connect(echo_proxy) as existing:
        assert _echo(existing, b"ping") == b"ping"
        echo_proxy.set_mode("reset")
        with pytest.raises(ConnectionResetError):
            existing.recv(1)
    # The RST can beat a new connect() to its result, so connecting is inside the raises.
    with pytest.raises(ConnectionResetError), _connect(echo_proxy) as new:
        new.recv(1)
    assert echo_proxy.requests_failed == 2


def test_reset_fails_http_requests(http_proxy: FaultProxy) -> None:
    http_proxy.set_mode("reset")
    with pytest.raises(ConnectionError):  # reset, broken pipe or RemoteDisconnected
        _request(http_proxy)
    assert http_proxy.requests_failed == 1


def test_refuse_then_recover_on_same_port(echo_proxy: FaultProxy) -> None:
    port = echo_proxy.port
    with _connect(echo_proxy) as existing:
        assert _echo(existing, b"ping") == b"ping"
        echo_proxy.set_mode("refuse")
        with pytest.raises(ConnectionResetError):
            existing.recv(1)
    with pytest.raises(ConnectionRefusedError):
        _connect(echo_proxy)
    with socket.socket() as other, pytest.raises(OSError):  # the port stays ours meanwhile
        other.bind((LOOPBACK, port))
    echo_proxy.set_mode("pass")
    with _connect(echo_proxy) as sock:
        assert _echo(sock, b"back") == b"back"
    assert echo_proxy.port == port
    assert echo_proxy.connections == 2


def test_refuse_twice_then_pass_forwards(http_proxy: FaultProxy) -> None:
    """An outage set twice in a row (as a generated sequence of operations does) ends
    like one: the next request passes whole, an ``Expect: 100-continue`` upload (what
    botocore sends for every PutObject) included."""
    http_proxy.set_mode("refuse")
    http_proxy.set_mode("refuse")
    with pytest.raises(ConnectionRefusedError):
        _connect(http_proxy)
    http_proxy.set_mode("pass")
    body = bytes(range(256)) * 400
    with _connect(http_proxy) as sock:
        sock.sendall(
            b"PUT /obj HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        assert sock.recv(65536).startswith(b"HTTP/1.1 100")
        sock.sendall(body)
        reply = b""
        while not reply.endswith(body) and (chunk := sock.recv(65536)):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(body)


def test_freeze_hangs_new_requests(http_proxy: FaultProxy, http_upstream: _HTTPUpstream) -> None:
    hits = http_upstream.hits
    http_proxy.set_mode("freeze")
    with pytest.raises(TimeoutError):  # the client's own 0.3 s timeout
        _request(http_proxy, "PUT", b"data", timeout=0.3)
    assert http_proxy.connected.wait(5)
    assert http_upstream.hits == hits
    assert http_proxy.bytes_up == http_proxy.bytes_down == 0


def test_freeze_existing_connection_then_pass_drops_it(echo_proxy: FaultProxy) -> None:
    with _connect(echo_proxy, timeout=0.3) as sock:
        assert _echo(sock, b"before") == b"before"
        echo_proxy.set_mode("freeze")
        sock.sendall(b"during")
        with pytest.raises(TimeoutError):
            sock.recv(1)
        echo_proxy.set_mode("pass")
        with pytest.raises(ConnectionResetError):  # not resumed: "during" is never delivered
            sock.recv(1)
    with _connect(echo_proxy) as sock:
        assert _echo(sock, b"after") == b"after"
    assert echo_proxy.bytes_up == len(b"before") + len(b"after")


def test_connected_event_reports_attempts(http_proxy: FaultProxy) -> None:
    http_proxy.set_mode("freeze")
    http_proxy.connected.clear()
    conn = http.client.HTTPConnection(LOOPBACK, http_proxy.port, timeout=5)
    try:
        conn.request("GET", "/obj")  # sent into the void; no reply will come
        assert http_proxy.connected.wait(5)
    finally:
        conn.close()


def test_slow_delivers_the_same_bytes_later(echo_proxy: FaultProxy) -> None:
    payload = bytes(range(256)) * 400  # 100 KiB
    echo_proxy.set_mode("slow", delay=0.02, bytes_per_second=1_000_000)
    started = time.monotonic()
    with _connect(echo_proxy) as sock:
        got = _echo(sock, payload)
    elapsed = time.monotonic() - started
    assert got == payload
    assert elapsed >= 2 * len(payload) / 1_000_000  # capped on the way up and down
    assert echo_proxy.bytes_up == echo_proxy.bytes_down == len(payload)


def test_flaky_fails_every_second_connection(http_proxy: FaultProxy) -> None:
    http_proxy.set_mode("flaky", every=2)
    outcomes: list[int | str] = []
    for _ in range(6):
        try:
            outcomes.append(_request(http_proxy)[0])
        except ConnectionError:
            outcomes.append("reset")
    assert outcomes == [200, "reset", 200, "reset", 200, "reset"]
    assert http_proxy.connections == 6
    assert http_proxy.requests_failed == 3


@pytest.mark.parametrize(
    ("mode", "params", "error"),
    [
        ("explode", {}, ValueError),
        ("pass", {"delay": 1}, TypeError),
        ("flaky", {"every": 0}, ValueError),
        ("slow", {"bytes_per_second": 0}, ValueError),
        ("http_error", {"status": 42}, ValueError),
    ],
)
def test_set_mode_rejects_bad_arguments(
    mode: str, params: dict[str, Any], error: type[Exception]
) -> None:
    proxy = FaultProxy((LOOPBACK, 1))
    with pytest.raises(error):
        proxy.set_mode(mode, **params)  # type: ignore[arg-type]
    assert proxy.mode == "pass"
