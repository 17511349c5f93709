"""The peer bulk listener under a hostile network: callers without the token cannot
take the transfer slots, a caller that trickles is cut at the request deadline, a
sender that goes silent loses its replica and its budget reservation, and a bulk
listener that fails its transfers is replaced by the Peer gRPC service, with the
restore none the wiser. The listener alone first, then real daemons."""

from __future__ import annotations

import select
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from ckptd.core.manifest import Manifest, RankRecord
from ckptd.core.wire import CHANNEL_OPTIONS
from ckptd.daemon.app import config
from ckptd.daemon.peer import bulk
from ckptd.daemon.peer.bulk import BulkServer, request_frame
from ckptd.daemon.peer.incoming import Incoming
from ckptd.daemon.peer.replicas import ReplicaStore
from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import ckptd_pb2_grpc as pb_grpc

from .pki import make_pki
from .servers import free_port
from .test_peer_tier import TOKEN as CLUSTER_TOKEN
from .test_peer_tier import Cluster, same, state
from .test_peer_tls import tls_of
from .unit.daemon.peer.test_bulk import DATA, FILES, TOKEN, _read, _req
from .unit.daemon.peer.test_peer import _manifest

SOURCES = [f"127.0.0.{i}" for i in range(2, 10)]
"""Addresses the idle connections come from (all of 127/8 is loopback on Linux);
the daemons' own transfers come from 127.0.0.1."""
BOUND = 60.0
"""How long a test waits for what must happen well before (a failure, not a sync)."""


class Flood:
    """``per_source`` connections from each of ``sources`` that never send a byte,
    each opened again shortly after the listener closes it, until closed."""

    def __init__(self, port: int, per_source: int, sources: list[str] = SOURCES) -> None:
        self.port = port
        self.slots = [s for s in sources for _ in range(per_source)]
        self.closed = 0
        """Connections the listener closed (evicted, cut, refused)."""
        self._sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        for i in range(len(self.slots)):
            self._open(i)
        self._thread.start()

    def _open(self, i: int) -> None:
        sock = socket.socket()
        sock.bind((self.slots[i], 0))
        try:
            sock.connect(("127.0.0.1", self.port))
        except OSError:
            sock.close()
            return
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, i)

    def _run(self) -> None:
        again: list[tuple[float, int]] = []
        while not self._stop.is_set():
            for key, _ in self._sel.select(0.05):
                self._sel.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
                self.closed += 1
                # Paced: an attacker on a slower clock than the test's machine.
                again.append((time.monotonic() + 0.2, key.data))
            due = [i for at, i in again if at <= time.monotonic()]
            again = [(at, i) for at, i in again if at > time.monotonic()]
            for i in due:
                self._open(i)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[BulkServer]:
    """A listener holding one replica, with a short request deadline and idle time."""
    store = ReplicaStore(tmp_path, 10**9)
    store.load()
    incoming = store.begin("j", 5, _manifest(5, FILES))
    assert isinstance(incoming, Incoming)
    incoming.write(b"".join(FILES.values()))
    incoming.finish()
    server = BulkServer(store, TOKEN, deadline=1.0, idle=0.5)
    server.start("127.0.0.1")
    yield server
    server.stop()


def test_idle_unauthenticated_connections_leave_the_transfers_alone(served: BulkServer) -> None:
    """64 connections from 8 addresses fill every unauthenticated place (and twice the
    transfer slots); a daemon's reads still go through, one after another."""
    flood = Flood(served.port, bulk.MAX_UNAUTHENTICATED_PER_SOURCE)
    try:
        for _ in range(bulk.MAX_CONNECTIONS + 4):
            assert _read(served, _req(length=4096)) == DATA[:4096]
    finally:
        flood.close()


def test_one_address_cannot_hold_more_than_its_share(
    served: BulkServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ninth idle connection from one address closes that address's oldest."""
    monkeypatch.setattr(bulk, "AUTH_SECONDS", 10 * BOUND)  # no deadline cuts them first
    served.deadline = 10 * BOUND
    extra = 4
    socks = []
    for _ in range(bulk.MAX_UNAUTHENTICATED_PER_SOURCE + extra):
        sock = socket.socket()
        sock.bind((SOURCES[0], 0))
        sock.connect(("127.0.0.1", served.port))
        socks.append(sock)
    try:
        for sock in socks[:extra]:  # closed for the newer ones (recv: the end, at once)
            sock.settimeout(BOUND)
            assert sock.recv(64) == b""
    finally:
        for sock in socks:
            sock.close()


def _cut_while_trickling(sock: socket.socket, data: bytes) -> bool:
    """Send ``data`` a byte at a time, slowly; whether the listener closed the
    connection (or answered) before all of it was sent (an answer to the whole
    request is no cut)."""
    sock.setblocking(True)
    for i in range(len(data)):
        try:
            sock.sendall(data[i : i + 1])
        except OSError:  # reset: closed
            return True
        ready, _, _ = select.select([sock], [], [], 0.02)
        if not ready:
            continue
        sock.setblocking(False)
        try:
            sock.recv(64)  # the end, or a refusal: the listener is done with it
        except (ssl.SSLWantReadError, BlockingIOError):
            continue  # nothing for the caller (a TLS session ticket)
        except OSError:  # reset: closed
            return True
        finally:
            sock.setblocking(True)
        return i + 1 < len(data)
    return False


@pytest.mark.parametrize("phase", ["before-the-token", "after-the-token"])
def test_a_trickling_sender_is_cut_at_the_deadline(served: BulkServer, phase: str) -> None:
    if phase == "before-the-token":  # a 1000-byte token claimed, its bytes trickled
        data = bulk.MAGIC + struct.pack("<I", 1000) + b"x" * 1000
    else:  # the token at once, then a 1000-byte request trickled
        data = request_frame(TOKEN, {})[:-6] + struct.pack("<I", 1000) + b" " * 1000
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        if phase == "after-the-token":
            sock.sendall(data[:-1000])
            data = data[-1000:]
        assert _cut_while_trickling(sock, data)
    assert served.cut > 0


def test_a_request_trickled_over_tls_is_cut_at_the_deadline(tmp_path: Path) -> None:
    """Over mutual TLS (a caller with a certificate of the CA) the deadline holds
    inside the encrypted stream too: a token trickled a byte at a time is cut."""
    store = ReplicaStore(tmp_path / "store", 10**9)
    store.load()
    tls = tls_of(make_pki(tmp_path / "pki"))
    server = BulkServer(store, TOKEN, tls, deadline=1.0)
    server.start("127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as raw:
            context = tls.client_context()
            hostname = tls.hostname("127.0.0.1")
            with context.wrap_socket(raw, server_hostname=hostname) as sock:
                assert _cut_while_trickling(
                    sock, bulk.MAGIC + struct.pack("<I", 1000) + b"x" * 1000
                )
    finally:
        server.stop()


def test_a_slow_reader_is_cut_at_the_deadline(served: BulkServer) -> None:
    """A ranged read taken a KiB at a time: the listener stops sending at the
    deadline (the bytes so far come, then the end)."""
    with socket.socket() as sock:
        # A small window (set before connecting), so that the listener's sends block
        # rather than the whole range landing in the kernel's buffers at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.connect(("127.0.0.1", served.port))
        sock.sendall(request_frame(TOKEN, {**_req(), "op": "get"}))
        got = 0
        while got < len(DATA) + 10:
            ready, _, _ = select.select([sock], [], [], BOUND)
            assert ready, "the listener neither sent nor closed"
            piece = sock.recv(65536)
            if not piece:
                break
            got += len(piece)
            time.sleep(0.02)  # the slow reader's pace, not a sync
        assert got < len(DATA) + 10  # cut short: the whole range never came


def test_a_silent_put_is_dropped_with_its_reservation(served: BulkServer) -> None:
    """A put claiming 600 MB of a 1 GB budget that sends nothing: dropped after the
    idle time, and the next 600 MB replica fits."""
    huge = RankRecord(0, "rank-00000.safetensors", 600 * 10**6, 0, None)
    raw = Manifest("j", 6, "src", 1, 1.0, [huge]).to_json()
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(request_frame(TOKEN, {"op": "put", "job": "j", "step": 6, "manifest": raw}))
        sock.settimeout(BOUND)
        assert sock.recv(2) == b"GO"
        answer = b""
        while chunk := sock.recv(4096):  # the listener answers once it drops it
            answer += chunk
    assert answer.startswith(b"ER") and b"peer_idle_seconds" in answer
    again = served.store.begin("j", 7, Manifest("j", 7, "src", 1, 1.0, [huge]).to_json())
    assert isinstance(again, Incoming)
    again.abort()
    assert list((served.store.dir / ".incoming").iterdir()) == []


# Real daemons.


def _replicate(cluster: Cluster) -> dict[str, Any]:
    """node-a saves step 3 and its replica lands on node-b; the state saved."""
    a = cluster.daemons["node-a"]
    saved = state(3)
    a.client("job").save(3, saved).wait("local", BOUND)
    cluster.replicated("node-a", "job", 3, BOUND)
    replicated = a.events_of(pb.STEP_EVENT_REPLICATED, "job", 3)
    assert [dict(e.attributes) for e in replicated] == [{"nodes": "node-b"}]
    return saved


def _restore_from_peer(cluster: Cluster, saved: dict[str, Any]) -> None:
    """node-a loses its disk and takes step 3 back from node-b, bit-exact (no
    bucket: from the peer or not at all)."""
    a, b = cluster.daemons["node-a"], cluster.daemons["node-b"]
    cluster.lose("node-a").start()
    tree, _ = a.client("job").restore()
    same(tree, saved)
    fetched = a.events_of(pb.STEP_EVENT_FETCHED, "job", 3)
    assert [dict(e.attributes) for e in fetched] == [{"node": "node-b", "via": "peer"}]
    # Counted by node-b's serving thread after its last send: it may come after the
    # restore is done.
    deadline = time.monotonic() + BOUND
    while b.status().peer_served_bytes < b.status().replicas_held_bytes:
        assert time.monotonic() < deadline, b.status()
        time.sleep(0.05)
    assert b.status().peer_served_bytes == b.status().replicas_held_bytes


def test_idle_connections_to_the_bulk_port_do_not_stop_a_peer_restore(
    make_daemon: Any, tmp_path: Path
) -> None:
    cluster = Cluster(make_daemon, tmp_path)
    saved = _replicate(cluster)
    port = cluster.daemons["node-b"].status().peer_data_port
    flood = Flood(port, bulk.MAX_UNAUTHENTICATED_PER_SOURCE)
    try:
        _restore_from_peer(cluster, saved)
    finally:
        flood.close()


@pytest.mark.parametrize("op", ["get", "put"])
def test_a_failing_bulk_listener_falls_back_to_the_peer_service(
    make_daemon: Any, tmp_path: Path, op: str
) -> None:
    """node-b's bulk listener refuses every read (the replica comes back with
    GetReplicaFile), or every put (it goes to node-b with PutReplica, not past it)."""
    points = {"CKPTD_FAILPOINTS": f"peer.bulk_{op}=enospc"}
    cluster = Cluster(make_daemon, tmp_path, env={"node-b": points})
    assert cluster.daemons["node-b"].status().peer_data_port > 0
    _restore_from_peer(cluster, _replicate(cluster))


@pytest.fixture
def peer_daemon(make_daemon: Any, tmp_path: Path) -> tuple[Any, int]:
    """A daemon taking replicas, with short limits; (it, its Peer service port)."""
    token = tmp_path / "peer-token"
    token.write_text(CLUSTER_TOKEN + "\n")
    token.chmod(0o600)
    # The node "src" whose replicas the tests send: a replica is taken only from the
    # `peers` entry answering as its node (daemon/peer/identity.py), here 127.0.0.1.
    src_port = free_port()
    src_args = [
        "--node-id", "src",
        "--peer-address", f"127.0.0.1:{src_port}",
        "--peer-token-file", str(token),
    ]  # fmt: skip
    make_daemon(extra_args=src_args)
    port = free_port()
    args = [
        "--peer-address", f"127.0.0.1:{port}",
        "--peers", f"127.0.0.1:{src_port}",
        "--peer-token-file", str(token),
        "--peer-budget-bytes", "1GB",
        "--peer-bulk-deadline-seconds", "1",
        "--peer-idle-seconds", "1",
        "--peer-max-lag-seconds", "0.5",
    ]  # fmt: skip
    return make_daemon(extra_args=args), port


def test_a_trickling_sender_is_cut_by_a_daemon(peer_daemon: tuple[Any, int]) -> None:
    d, _ = peer_daemon
    with socket.create_connection(("127.0.0.1", d.status().peer_data_port)) as sock:
        sock.sendall(request_frame(CLUSTER_TOKEN, {})[:-6] + struct.pack("<I", 1000))
        assert _cut_while_trickling(sock, b" " * 1000)


def test_a_silent_put_replica_releases_its_budget(peer_daemon: tuple[Any, int]) -> None:
    """A PutReplica claiming 600 MB of a 1 GB budget, then silent: cut after
    peer_idle_seconds with a reason, and the next 600 MB replica fits."""
    _, port = peer_daemon
    stub = pb_grpc.PeerStub(grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS))
    metadata = (("authorization", f"Bearer {CLUSTER_TOKEN}"),)
    huge = RankRecord(0, "rank-00000.safetensors", 600 * 10**6, 0, None)
    done = threading.Event()

    def silent(step: int) -> Iterator[pb.ReplicaChunk]:
        raw = Manifest("job", step, "src", 1, 1.0, [huge]).to_json()
        yield pb.ReplicaChunk(job="job", step=step, manifest_json=raw)
        done.wait()  # the sender stops here, its stream open

    try:
        call = stub.PutReplica.future(silent(6), metadata=metadata, timeout=10 * BOUND)
        err = call.exception(timeout=BOUND)
        assert isinstance(err, grpc.RpcError)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "peer_idle_seconds" in (err.details() or "")
        done.set()  # the next stream ends after its manifest: refused as short, not
        with pytest.raises(grpc.RpcError) as short:  # as over the budget
            stub.PutReplica(silent(7), metadata=metadata, timeout=BOUND)
        assert short.value.code() == grpc.StatusCode.INVALID_ARGUMENT, short.value.details()
    finally:
        done.set()


@pytest.mark.parametrize(
    "flags,match",
    [
        ({"peer_idle_seconds": "20", "peer_max_lag_seconds": "30"}, "must exceed peer_max_lag"),
        ({"peer_bulk_deadline_seconds": "0"}, "peer_bulk_deadline_seconds.*positive"),
        ({"peer_idle_seconds": "soon"}, "peer_idle_seconds"),
    ],
)
def test_bad_limits_are_refused_with_what_to_do(flags: dict[str, str], match: str) -> None:
    with pytest.raises(config.ConfigError, match=match):
        config.load(env={}, flags=flags)
