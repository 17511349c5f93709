"""The peer tier's bulk data listener without daemons: ranges served by sendfile,
the token and names checked first, a transfer cut short reported, never taken."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import google_crc32c
import pytest

from ckptd.core.errors import DataLoss, Unavailable
from ckptd.daemon.peer import bulk
from ckptd.daemon.peer.bulk import BulkServer, request_frame
from ckptd.daemon.peer.bulk_client import push, read_range
from ckptd.daemon.peer.incoming import Incoming
from ckptd.daemon.peer.replicas import ReplicaStore

from .test_peer import _manifest

TOKEN = "bulk-test-token-0123456789abcdef"
DATA = bytes(range(256)) * 40_000  # 10 MB: several recv_into rounds and sendfile calls
FILES = {"rank-00000.safetensors": DATA, "rank-00001.safetensors": b"tiny"}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[BulkServer]:
    store = ReplicaStore(tmp_path, 10**9)
    store.load()
    incoming = store.begin("j", 5, _manifest(5, FILES))
    assert isinstance(incoming, Incoming)
    incoming.write(b"".join(FILES.values()))
    incoming.finish()
    server = BulkServer(store, TOKEN)
    server.start("127.0.0.1")
    yield server
    server.stop()


def _req(**over: object) -> dict[str, object]:
    req: dict[str, object] = {
        "job": "j",
        "source": "src",
        "step": 5,
        "file": "rank-00000.safetensors",
        "offset": 0,
        "length": len(DATA),
    }
    req.update(over)
    return req


def _read(
    server: BulkServer, req: dict[str, object], buf_bytes: int = 65536, token: str = TOKEN
) -> bytes:
    out = bytearray()
    crc = read_range(
        ("127.0.0.1", server.port),
        token,
        req,
        memoryview(bytearray(buf_bytes)),
        lambda piece: out.extend(piece),
    )
    assert crc == google_crc32c.value(bytes(out))
    return bytes(out)


def test_whole_files_and_ranges_come_back_exact(served: BulkServer) -> None:
    assert _read(served, _req()) == DATA
    assert _read(served, _req(offset=12345, length=3_000_001)) == DATA[12345:3_012_346]
    assert _read(served, _req(file="rank-00001.safetensors", length=4)) == b"tiny"
    assert _read(served, _req(offset=len(DATA), length=0)) == b""
    # Counted by the serving thread after its last send: the reader may finish first.
    deadline = time.monotonic() + 60
    while served.served_bytes < len(DATA) + 3_000_001 + 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.served_bytes == len(DATA) + 3_000_001 + 4


@pytest.mark.parametrize(
    "over,reason",
    [
        ({"job": "../x"}, "job"),
        ({"source": "a/b"}, "node"),
        ({"step": 4}, "no replica of step 4"),
        ({"file": "../../etc/passwd"}, "not a file"),
        ({"offset": len(DATA) - 10, "length": 11}, "outside the file"),
        ({"offset": -1}, "outside the file"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(
    served: BulkServer, over: dict[str, object], reason: str
) -> None:
    with pytest.raises(Unavailable, match=reason):
        _read(served, _req(**over))
    assert served.served_bytes == 0


@pytest.mark.parametrize("token", ["not-the-token-at-all-0123456789", "", "x" * 5000])
def test_a_wrong_token_is_refused_before_the_request_is_read(
    served: BulkServer, token: str
) -> None:
    with pytest.raises(Unavailable, match="peer_token_file"):
        _read(served, _req(), token=token)
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as conn:
        # A request claiming 1 GiB of JSON behind a wrong token: refused at once.
        frame = request_frame("wrong-token", {})
        conn.sendall(frame[:-6] + struct.pack("<I", 1 << 30))
        assert conn.recv(2) == b"ER"


def test_a_request_outside_the_protocol_is_dropped_and_the_server_goes_on(
    served: BulkServer,
) -> None:
    huge = request_frame(TOKEN, {})[:-6] + struct.pack("<I", 1 << 30)
    for junk in (b"GET / HTTP/1.1\r\n\r\n", huge):
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as conn:
            conn.sendall(junk)
            assert conn.recv(2) == b"ER"
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as conn:
        key, body = TOKEN.encode(), b"[1, 2]"
        conn.sendall(bulk.MAGIC + struct.pack("<I", len(key)) + key)
        conn.sendall(struct.pack("<I", len(body)) + body)
        assert conn.recv(2) == b"ER"
    assert _read(served, _req()) == DATA


def test_a_transfer_cut_short_raises_and_a_wrong_length_is_refused() -> None:
    """A fake listener that promises more than it sends, or a different length."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve(promise: int, send: bytes) -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"OK" + struct.pack("<Q", promise) + send)

    for promise, send, error, match in (
        (100, b"x" * 40, Unavailable, "after 40 of 100"),
        (99, b"x" * 99, DataLoss, "offered 99 bytes, not 100"),
    ):
        t = threading.Thread(target=serve, args=(promise, send))
        t.start()
        with pytest.raises(error, match=match):
            read_range(
                ("127.0.0.1", port),
                TOKEN,
                {"length": 100},
                memoryview(bytearray(64)),
                lambda p: None,
            )
        t.join()
    listener.close()


def test_a_closed_listener_is_unavailable(served: BulkServer) -> None:
    served.stop()
    with pytest.raises(Unavailable, match="peer data connection"):
        _read(served, _req())


def _push(
    server: BulkServer, step: int, files: dict[str, bytes], cut: int = 0, data: bytes = b""
) -> int:
    """Push a replica of ``files`` (its bytes: ``data`` if given, less ``cut``)."""
    data = data or b"".join(files.values())

    async def pieces() -> AsyncIterator[memoryview]:
        for at in range(0, len(data) - cut, 3_000_000):  # not a multiple of anything
            yield memoryview(data)[at : min(at + 3_000_000, len(data) - cut)]

    async def run() -> int:
        request = {"job": "j", "step": step, "manifest": _manifest(step, files)}
        total = sum(map(len, files.values()))
        return await push(("127.0.0.1", server.port), TOKEN, request, pieces, total)

    return asyncio.run(run())


def test_a_pushed_replica_is_held_replaced_and_served(served: BulkServer) -> None:
    files = {"rank-00000.safetensors": DATA[::-1], "rank-00001.safetensors": b"x" * 7}
    assert _push(served, 6, files) == len(DATA) + 7
    assert served.received_bytes == len(DATA) + 7
    assert [h.step for h in served.store.list()] == [6]  # step 5's replica replaced
    assert _read(served, _req(step=6, length=len(DATA))) == DATA[::-1]
    assert _push(served, 6, files) == len(DATA) + 7  # held already: nothing sent
    assert served.received_bytes == len(DATA) + 7


def test_a_bad_push_is_refused_and_leaves_the_older_replica(served: BulkServer) -> None:
    files = {"rank-00000.safetensors": DATA[::-1], "rank-00001.safetensors": b"x" * 7}
    with pytest.raises(Unavailable):  # a byte differs from the manifest's crc32c
        _push(served, 6, files, data=DATA[::-1] + b"x" * 6 + b"y")
    assert [h.step for h in served.store.list()] == [5]
    assert list((served.store.dir / ".incoming").iterdir()) == []


def test_the_request_is_json_under_the_cap() -> None:
    body = json.dumps(_req()).encode()
    assert len(body) < bulk.MAX_REQUEST


def test_a_pusher_whose_files_come_short_raises(served: BulkServer) -> None:
    files = {"rank-00000.safetensors": DATA[::-1], "rank-00001.safetensors": b"x" * 7}
    with pytest.raises(Unavailable, match="came to"):
        _push(served, 7, files, cut=5)  # it closes; the receiver drops it (below)


def test_a_sender_that_closes_short_gets_nothing_held(served: BulkServer) -> None:
    """The receiver's own check (the pusher's count aside): fewer bytes than the
    manifest names, then the end of the stream, and the replica is dropped."""
    files = {"rank-00000.safetensors": DATA[::-1], "rank-00001.safetensors": b"x" * 7}
    request = {"op": "put", "job": "j", "step": 8, "manifest": _manifest(8, files)}
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as conn:
        conn.sendall(request_frame(TOKEN, request))
        assert conn.recv(2) == b"GO"
        conn.sendall(DATA[::-1][:1000])
        conn.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
        assert answer.startswith(b"ER") and b"bytes of the replica to come" in answer
    assert [h.step for h in served.store.list()] == [5]
    assert list((served.store.dir / ".incoming").iterdir()) == []
    assert served.received_bytes == 0
