"""A counting reverse HTTP proxy in front of an S3 endpoint (SeaweedFS in the benchmarks).

Every request is forwarded as received (method, raw path and query, headers, the body
streamed) to the upstream endpoint, with the client's own ``Host`` header, so SigV4
signatures (headers or presigned query) still verify; the response is streamed back
unchanged (status, ``Content-Length``, ``ETag``, checksum headers). Only hop-by-hop
headers are dropped; ``Expect: 100-continue`` is answered here (botocore does not
sign it).

Each request is classified into an S3 operation (``s3ops.classify``) and counted per
operation: requests, status classes, bytes each way, upstream latency, ranged GETs;
for LISTs the keys and common prefixes each response returned, whether it was
truncated, and how many of the keys belong to the calling node or to other nodes. The
caller is named by the access key in its signature (``Authorization`` header or
presigned ``X-Amz-Credential``): give each node its own key to attribute requests.

Run it as a subprocess (:class:`ProxyProcess`, so it does not compete for the GIL with
the harness) with a control API on the same port::

    GET  /__counts   the counters (JSON)
    POST /__reset    the counters (JSON), then zeroes them

or directly: ``python bench/scale/proxy.py --upstream http://127.0.0.1:8333``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from s3ops import LIST_KINDS, LISTS, Counters, caller_of, classify

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "trailers", "transfer-encoding",
                        "upgrade", "expect"})  # fmt: skip
SKIP_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
"""Headers aiohttp would add on its own: only what the client sent is forwarded."""
LIST_BODY_MAX = 64 * 2**20


async def _counted(reader: Any, rec: dict[str, Any]) -> AsyncIterator[bytes]:
    async for chunk in reader.iter_any():
        rec["req_bytes"] = rec.get("req_bytes", 0) + len(chunk)
        yield chunk


class Proxy:
    """The aiohttp application: forwards to ``upstream`` and counts."""

    def __init__(self, upstream: str, counters: Counters) -> None:
        self.upstream = upstream.rstrip("/")
        self.counters = counters
        self.session: Any = None

    async def handle(self, request: Any) -> Any:
        from aiohttp import ClientError, web
        from yarl import URL

        if request.path.startswith("/__"):
            return await self.control(request)
        query = dict(parse_qsl(request.rel_url.raw_query_string, keep_blank_values=True))
        headers = request.headers
        kind = classify(request.method, request.path, query, headers)
        caller = caller_of(headers, query)
        _, _, key = request.path.lstrip("/").partition("/")
        if kind in LIST_KINDS:
            key = query.get("prefix", key) + ("  [delimiter]" if query.get("delimiter") else "")
        self.counters.begin(kind, caller, self.counters.pattern(key))
        rec: dict[str, Any] = {"ranged": int("Range" in headers)}
        if kind in LISTS and LISTS[kind][0] not in query:
            rec["listings"] = 1
        t0 = time.monotonic()
        try:
            body: Any = None
            if kind == "DeleteObjects":
                raw = await request.read()
                rec["req_bytes"], rec["deleted"] = len(raw), raw.count(b"<Object>")
                body = raw
            elif request.body_exists:
                body = _counted(request.content, rec)
            out = [(k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP]
            url = URL(self.upstream + request.raw_path, encoded=True)
            try:
                up = await self.session.request(
                    request.method, url, headers=out, data=body, allow_redirects=False
                )
            except (TimeoutError, ClientError, OSError) as exc:
                return web.Response(status=502, text=f"proxy: upstream failed: {exc!r}\n")
            try:
                rec["status"] = up.status
                resp = web.StreamResponse(status=up.status, reason=up.reason)
                for k, v in up.headers.items():
                    if k.lower() not in HOP_BY_HOP:
                        resp.headers.add(k, v)
                keep = bytearray() if kind in LIST_KINDS else None
                rec["resp_bytes"] = 0
                try:
                    await resp.prepare(request)
                    async for chunk in up.content.iter_any():
                        rec["resp_bytes"] += len(chunk)
                        if keep is not None and len(keep) < LIST_BODY_MAX:
                            keep += chunk
                        await resp.write(chunk)
                    await resp.write_eof()
                except (TimeoutError, ConnectionError, ClientError):
                    rec["aborted"] = 1  # the caller hung up, or the upstream did
                    up.close()
                    return resp
                if keep is not None and up.status == 200:
                    self.counters.list_body(kind, caller, bytes(keep), rec)
                return resp
            finally:
                up.release()
        finally:
            rec["seconds"] = time.monotonic() - t0
            self.counters.end(kind, rec)

    async def control(self, request: Any) -> Any:
        from aiohttp import web

        c = self.counters
        if request.path == "/__counts" and request.method == "GET":
            if request.query.get("brief"):  # what wait_quiet polls
                return web.json_response(
                    {"in_flight": c.in_flight, "last_activity_unix": c.last_activity}
                )
            return web.json_response(c.snapshot())
        if request.path == "/__reset" and request.method == "POST":
            snap = self.counters.snapshot()
            self.counters.reset()
            return web.json_response(snap)
        return web.Response(status=404, text="unknown control path\n")


async def serve(upstream: str, sock: socket.socket, node_re: str) -> None:
    """Serve on ``sock`` until cancelled (SIGTERM/SIGINT)."""
    import aiohttp
    from aiohttp import web

    proxy = Proxy(upstream, Counters(node_re))
    proxy.session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600),
        auto_decompress=False,
        skip_auto_headers=SKIP_AUTO_HEADERS,
        cookie_jar=aiohttp.DummyCookieJar(),
        read_bufsize=2**20,
    )
    app = web.Application(client_max_size=LIST_BODY_MAX)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=120, handle_signals=False)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.getppid()
    try:
        while not stop.is_set() and os.getppid() == parent:  # the harness died: exit too
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    finally:
        await runner.cleanup()
        await proxy.session.close()


class ProxyProcess:
    """The proxy as a subprocess: :meth:`start`, :attr:`url`, :meth:`snapshot`,
    :meth:`reset`, :meth:`wait_quiet`, :meth:`stop`."""

    def __init__(self, upstream: str, log_path: Path, node_re: str = r"node-\d+") -> None:
        self.upstream = upstream
        self.log_path = Path(log_path)
        self.node_re = node_re
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """The endpoint URL to give clients instead of the upstream's."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> ProxyProcess:
        """Spawn the proxy and wait until it reports its port."""
        fd, port_file = tempfile.mkstemp(prefix="ckptd-proxy-", suffix=".port")
        os.close(fd)
        os.unlink(port_file)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--upstream", self.upstream,
               "--port-file", port_file, "--node-re", self.node_re]  # fmt: skip
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while not os.path.exists(port_file) or not Path(port_file).read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"proxy did not start; see {self.log_path}")
            time.sleep(0.05)
        self.port = int(Path(port_file).read_text())
        os.unlink(port_file)
        return self

    def _call(self, method: str, path: str) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path, method=method, data=b"" if method == "POST" else None
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            result: dict[str, Any] = json.loads(r.read())
            return result

    def snapshot(self) -> dict[str, Any]:
        """The counters since the last reset."""
        return self._call("GET", "/__counts")

    def reset(self) -> dict[str, Any]:
        """The counters since the last reset; then zero them."""
        return self._call("POST", "/__reset")

    def wait_quiet(self, quiet: float = 3.0, timeout: float = 300.0) -> bool:
        """Wait until no request is in flight and none began or ended for ``quiet`` s;
        False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = self._call("GET", "/__counts?brief=1")
            idle = time.time() - snap["last_activity_unix"]
            if snap["in_flight"] == 0 and idle >= quiet:
                return True
            time.sleep(min(0.5, max(0.05, quiet - idle)))
        return False

    def stop(self) -> None:
        """SIGTERM the proxy (SIGKILL after 5 s)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def main() -> None:
    """``python proxy.py --upstream URL [--port N] [--port-file PATH]``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="the S3 endpoint, e.g. http://127.0.0.1:8333")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port")
    p.add_argument("--port-file", help="write the port here once listening")
    p.add_argument("--node-re", default=r"node-\d+", help="a node id inside object keys")
    args = p.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(1024)
    port = sock.getsockname()[1]
    if args.port_file:
        tmp = args.port_file + ".tmp"
        Path(tmp).write_text(str(port))
        os.replace(tmp, args.port_file)
    print(f"proxy on {args.host}:{port} -> {args.upstream}", flush=True)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(serve(args.upstream, sock, args.node_re))


if __name__ == "__main__":
    main()
