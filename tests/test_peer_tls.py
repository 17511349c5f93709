"""Mutual TLS on the peer tier: the data listener and the Peer service serve only
callers with a certificate from the configured CA, over TLS, and three daemons
configured with the files restore a lost node from a peer bit-exact."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from ckptd.core.errors import FailedPrecondition, Unavailable
from ckptd.core.wire import CHANNEL_OPTIONS
from ckptd.daemon.app import config
from ckptd.daemon.peer.bulk import BulkServer
from ckptd.daemon.peer.bulk_client import push, read_range
from ckptd.daemon.peer.incoming import Incoming
from ckptd.daemon.peer.link import Peers
from ckptd.daemon.peer.options import PeerTlsFiles
from ckptd.daemon.peer.replicas import ReplicaStore
from ckptd.daemon.peer.service import PeerServicer
from ckptd.daemon.peer.tls import PeerTls
from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import ckptd_pb2_grpc as pb_grpc

from .pki import SHARED_NAME, Pki, make_pki
from .test_peer_tier import TOKEN, Cluster, same, state
from .unit.daemon.peer.test_peer import _manifest

DATA = bytes(range(256)) * 20_000
FILES = {"rank-00000.safetensors": DATA}


def tls_of(pki: Pki, server_name: str = "") -> PeerTls:
    tls = PeerTls.load(PeerTlsFiles(str(pki.cert), str(pki.key), str(pki.ca), server_name))
    assert tls is not None
    return tls


@pytest.fixture(scope="module")
def pkis(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pki, Pki]:
    """The cluster's CA and node certificate, and an unrelated CA's."""
    root = tmp_path_factory.mktemp("pki")
    return make_pki(root / "ours"), make_pki(root / "rogue")


@pytest.fixture(scope="module")
def named(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA and a node certificate naming ``localhost`` only (no IP address)."""
    return make_pki(tmp_path_factory.mktemp("pki-named"), san="DNS:localhost")


def _store(root: Path) -> ReplicaStore:
    store = ReplicaStore(root, 10**9)
    store.load()
    incoming = store.begin("j", 5, _manifest(5, FILES))
    assert isinstance(incoming, Incoming)
    incoming.write(DATA)
    incoming.finish()
    return store


@pytest.fixture
def served(tmp_path: Path, pkis: tuple[Pki, Pki]) -> Iterator[BulkServer]:
    server = BulkServer(_store(tmp_path), TOKEN, tls_of(pkis[0]))
    server.start("127.0.0.1")
    yield server
    server.stop()


def _install(pki: Pki, into: Path) -> Pki:
    """``pki``'s files at fixed paths in ``into``, each replaced in one rename (as a
    renewed Secret appears under its mount)."""
    into.mkdir(exist_ok=True)
    out = Pki(ca=into / "ca.crt", cert=into / "tls.crt", key=into / "tls.key")
    for src, dst in ((pki.ca, out.ca), (pki.cert, out.cert), (pki.key, out.key)):
        tmp = dst.with_suffix(".tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    return out


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _read(server: BulkServer, tls: PeerTls | None, length: int = len(DATA)) -> bytes:
    out = bytearray()
    read_range(
        ("127.0.0.1", server.port),
        TOKEN,
        {"job": "j", "source": "src", "step": 5, "file": "rank-00000.safetensors",
         "offset": 0, "length": length},
        memoryview(bytearray(65536)),
        out.extend,
        tls,
    )  # fmt: skip
    return bytes(out)


def test_the_data_listener_serves_only_callers_with_a_certificate_of_the_ca(
    served: BulkServer, pkis: tuple[Pki, Pki]
) -> None:
    ours, rogue = pkis
    assert _read(served, tls_of(ours)) == DATA
    assert _read(served, tls_of(ours, SHARED_NAME)) == DATA  # the shared name checked
    with pytest.raises(Unavailable, match="peer data connection"):
        _read(served, None, 10)  # plain TCP: the handshake fails, nothing read
    with pytest.raises(Unavailable):
        _read(served, tls_of(rogue), 10)  # a certificate of another CA
    with pytest.raises(Unavailable, match="certificate"):
        _read(served, tls_of(ours, "someone-else"), 10)  # not the name the peer holds
    assert served.served_bytes == 2 * len(DATA)


def test_a_replica_is_pushed_over_tls_and_a_short_one_is_dropped(
    served: BulkServer, pkis: tuple[Pki, Pki]
) -> None:
    files = {"rank-00000.safetensors": DATA[::-1]}

    async def run(data: bytes) -> int:
        async def pieces() -> AsyncIterator[memoryview]:
            for at in range(0, len(data), 1_000_000):
                yield memoryview(data)[at : at + 1_000_000]

        request = {"job": "j", "step": 6, "manifest": _manifest(6, files)}
        address = ("127.0.0.1", served.port)
        return await push(address, TOKEN, request, pieces, len(DATA), tls_of(pkis[0]))

    with pytest.raises(Unavailable, match="came to"):
        asyncio.run(run(DATA[::-1][:-10]))  # the sender comes short: it closes
    assert [h.step for h in served.store.list()] == [5]
    assert asyncio.run(run(DATA[::-1])) == len(DATA)
    assert [h.step for h in served.store.list()] == [6]


def test_tls_files_are_checked_at_start_up(tmp_path: Path, pkis: tuple[Pki, Pki]) -> None:
    ours, rogue = pkis
    with pytest.raises(FailedPrecondition, match="cannot read peer_tls_key_file"):
        PeerTls.load(PeerTlsFiles(str(ours.cert), str(tmp_path / "missing.key"), str(ours.ca)))
    with pytest.raises(FailedPrecondition, match="its own private key"):
        # The key is not this certificate's.
        PeerTls.load(PeerTlsFiles(str(ours.cert), str(rogue.key), str(ours.ca)))
    with pytest.raises(config.ConfigError, match="needs all of"):
        config.load(None, {}, {"peer_tls_cert_file": str(ours.cert)})


def test_three_daemons_over_mutual_tls_restore_a_lost_node_bit_exact(
    make_daemon: Any, tmp_path: Path, pkis: tuple[Pki, Pki], named: Pki
) -> None:
    """The peers are listed as ``localhost:PORT`` and the certificates name only
    ``localhost``: the name checked is the entry's, not the address it resolved to."""
    rogue = pkis[1]
    tls_args = [
        "--peer-tls-cert-file", str(named.cert),
        "--peer-tls-key-file", str(named.key),
        "--peer-tls-ca-file", str(named.ca),
        "--peer-identity", "address",  # one certificate shared by every node
    ]  # fmt: skip
    cluster = Cluster(make_daemon, tmp_path, extra_args=tls_args, peer_host="localhost")
    a = cluster.daemons["node-a"]
    client = a.client("job")
    saved = state(3)
    client.save(3, saved).wait("local", 60)
    cluster.replicated("node-a", "job", 3)  # node-b took it over TLS
    # The Peer service: no answer without TLS, nor to a certificate of another CA.
    address = f"127.0.0.1:{cluster.ports['node-b']}"
    good = (("authorization", f"Bearer {TOKEN}"),)
    rogue_creds = grpc.ssl_channel_credentials(
        named.ca.read_bytes(), rogue.key.read_bytes(), rogue.cert.read_bytes()
    )
    as_localhost = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", "localhost")]
    for channel in (
        grpc.insecure_channel(address, options=CHANNEL_OPTIONS),
        grpc.secure_channel(address, rogue_creds, options=as_localhost),
    ):
        with channel, pytest.raises(grpc.RpcError) as err:
            pb_grpc.PeerStub(channel).Hello(pb.PeerHelloRequest(), metadata=good, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    cluster.lose("node-a").start()
    tree, _ = client.restore()
    same(tree, saved)
    fetched = a.events_of(pb.STEP_EVENT_FETCHED, "job", 3)
    assert [dict(e.attributes) for e in fetched] == [{"node": "node-b", "via": "peer"}]


def test_renewed_files_are_taken_by_new_data_connections(
    tmp_path: Path, pkis: tuple[Pki, Pki]
) -> None:
    ours, renewed = pkis  # renewed under another CA: the strongest change
    files = _install(ours, tmp_path / "tls")
    clock = _Clock()
    tls = PeerTls(str(files.cert), str(files.key), str(files.ca), reload_seconds=30, clock=clock)
    server = BulkServer(_store(tmp_path / "store"), TOKEN, tls)
    server.start("127.0.0.1")
    try:
        assert _read(server, tls_of(ours)) == DATA
        _install(renewed, tmp_path / "tls")
        assert _read(server, tls_of(ours)) == DATA  # not looked at again yet
        clock.now = 31.0
        assert _read(server, tls_of(renewed)) == DATA
        assert tls.generation == 1
        with pytest.raises(Unavailable):
            _read(server, tls_of(ours), 10)  # the old CA is no longer trusted
        # A key not matching its certificate (files caught mid-update): kept the last.
        shutil.copyfile(ours.key, files.key)
        clock.now = 62.0
        assert _read(server, tls_of(renewed)) == DATA and tls.generation == 1
    finally:
        server.stop()


def test_renewed_files_are_taken_by_the_peer_service_and_new_channels(
    tmp_path: Path, pkis: tuple[Pki, Pki]
) -> None:
    ours, renewed = pkis
    server_files = _install(ours, tmp_path / "server")
    client_files = _install(ours, tmp_path / "client")
    clock = _Clock()

    def tls(files: Pki) -> PeerTls:
        return PeerTls(
            str(files.cert), str(files.key), str(files.ca), reload_seconds=30, clock=clock
        )

    server_tls, client_tls = tls(server_files), tls(client_files)

    async def hello(peers: Peers, address: str) -> str:
        stub = peers.stub(address)
        resp = await stub.Hello(pb.PeerHelloRequest(), metadata=peers.metadata, timeout=10)
        return str(resp.node)

    async def body() -> None:
        store = ReplicaStore(tmp_path / "store", 10**9)
        store.load()

        async def run(fn: Any, *args: Any) -> Any:
            return fn(*args)

        server = grpc.aio.server()
        pb_grpc.add_PeerServicer_to_server(PeerServicer("node-s", TOKEN, store, run), server)
        port = server.add_secure_port("127.0.0.1:0", server_tls.server_credentials())
        await server.start()
        address = f"127.0.0.1:{port}"
        peers = Peers("node-c", (), TOKEN, client_tls)
        try:
            assert await hello(peers, address) == "node-s"
            _install(renewed, tmp_path / "server")
            _install(renewed, tmp_path / "client")
            clock.now = 31.0
            # The client remakes its channel with the renewed files; the server shows
            # and asks for the renewed ones on the new connection.
            assert await hello(peers, address) == "node-s"
            assert client_tls.generation == server_tls.generation == 1
            stale = Peers("node-o", (), TOKEN, tls_of(ours))  # still on the old CA
            with pytest.raises(grpc.RpcError) as err:
                await hello(stale, address)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await stale.close()
        finally:
            await peers.close()
            await server.stop(None)

    asyncio.run(body())


def test_names_checked_are_canonical_and_a_bad_or_encrypted_setting_is_refused(
    tmp_path: Path, pkis: tuple[Pki, Pki]
) -> None:
    ours = pkis[0]
    tls = tls_of(ours)
    # gRPC compares IP names as text: an entry's spelling of an address is normalized.
    assert tls.hostname("[FD00:0::5]") == "fd00::5"
    assert tls.hostname("127.000.0.1") == "127.000.0.1"  # not an address: a name as given
    assert tls.hostname("Node-1.example") == "Node-1.example"
    assert tls_of(ours, SHARED_NAME).hostname("10.0.0.7") == SHARED_NAME
    with pytest.raises(FailedPrecondition, match="not a host name"):
        tls_of(ours, "bad name/with slash")
    # An encrypted key is refused at once (OpenSSL would otherwise ask on a terminal).
    locked = tmp_path / "locked.key"
    subprocess.run(
        ["openssl", "pkey", "-in", str(ours.key), "-out", str(locked), "-aes256",
         "-passout", "pass:secret"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    with pytest.raises(FailedPrecondition, match="its own private key"):
        PeerTls(str(ours.cert), str(locked), str(ours.ca))
