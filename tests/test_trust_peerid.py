"""Peer identity: a peer takes a replica only as its authenticated sender's own.

A daemon holding the shared token but not being node A (another address, or a
certificate naming another node) cannot plant a replica of A's; A's own newer
replicas always replace the one held, so A restores its real newest step after
losing its disk; a token file others can read stops the start-up."""

from __future__ import annotations

import asyncio
import shutil
import socket
import struct
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from ckptd.core.errors import InvalidArgument, PermissionDenied, Unavailable
from ckptd.core.names import UNKNOWN_OWNER as NO_OWNER
from ckptd.core.wire import CHANNEL_OPTIONS
from ckptd.daemon.peer.bulk import request_frame
from ckptd.daemon.peer.bulk_client import push
from ckptd.daemon.peer.identity import Sender, SenderCheck, grpc_sender
from ckptd.daemon.peer.incoming import Incoming
from ckptd.daemon.peer.link import Peer, read_token
from ckptd.daemon.peer.replicas import ReplicaStore
from ckptd.daemon.peer.tls import PeerTls
from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import ckptd_pb2_grpc as pb_grpc

from .conftest import CKPTD, short_tmpdir
from .pki import Pki, make_pki
from .test_peer_tier import NODES, TOKEN, Cluster, same, state
from .unit.daemon.peer.test_peer import _manifest

DATA = bytes(range(256)) * 64
FILES = {"rank-00000.safetensors": DATA}
FORGED_STEP = 10**9
GOOD = (("authorization", f"Bearer {TOKEN}"),)


def _forged(node: str = "node-a") -> str:
    """A replica manifest of ``node``'s job ``job`` at a step far past any real one."""
    return _manifest(FORGED_STEP, FILES, job="job", node=node)


def _bulk_put_from(source_ip: str, port: int, raw: str) -> tuple[bytes, str]:
    """Push a replica to a bulk listener from ``source_ip``: (answer, reason)."""
    try:
        conn = socket.create_connection(("127.0.0.1", port), 30, source_address=(source_ip, 0))
    except OSError as exc:
        pytest.skip(f"cannot send from {source_ip} on this host's loopback ({exc})")
    with conn:
        req = {"op": "put", "job": "job", "step": FORGED_STEP, "manifest": raw}
        conn.sendall(request_frame(TOKEN, req))
        head = conn.recv(2, socket.MSG_WAITALL)
        if head == b"GO":
            conn.sendall(DATA)
            head = conn.recv(2, socket.MSG_WAITALL)
        if head == b"ER":
            (size,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
            return head, conn.recv(size, socket.MSG_WAITALL).decode()
        return head, ""


def _put_chunks(raw: str) -> list[pb.ReplicaChunk]:
    return [pb.ReplicaChunk(job="job", step=FORGED_STEP, manifest_json=raw, data=DATA)]


def test_a_replica_forged_by_a_token_holder_is_refused_and_the_node_restores_its_own(
    make_daemon: Any, tmp_path: Path
) -> None:
    """Token only: node-b takes node-a's replicas only from node-a's address."""
    cluster = Cluster(make_daemon, tmp_path)
    b = cluster.daemons["node-b"]
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.ports['node-b']}", options=CHANNEL_OPTIONS)
    stub = pb_grpc.PeerStub(channel)
    data_port = stub.Hello(pb.PeerHelloRequest(), metadata=GOOD, timeout=30).data_port
    # The bulk listener, from an address that is no peer's (node-a answers at 127.0.0.1).
    head, reason = _bulk_put_from("127.0.0.2", data_port, _forged("node-a"))
    assert head == b"ER", head
    assert "only node node-a's own daemon" in reason and "127.0.0.2" in reason
    # The Peer service, claiming a node that is not one of node-b's peers.
    with pytest.raises(grpc.RpcError) as err:
        stub.PutReplica(iter(_put_chunks(_forged("node-z"))), metadata=GOOD, timeout=30)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "list in `peers` every node" in err.value.details()
    assert b.status().replicas_held == 0
    channel.close()
    # node-a's own replicas are taken, and after losing its disk it restores its newest.
    a = cluster.daemons["node-a"]
    client = a.client("job")
    for step in (1, 2):
        saved = state(step)
        client.save(step, saved).wait("local", 60)
    cluster.replicated("node-a", "job", 2)
    cluster.lose("node-a").start()
    tree, _ = client.restore()
    same(tree, saved)


def _issue(pki: Pki, name: str, san: str) -> tuple[Path, Path]:
    """Another certificate from ``pki``'s CA (make_pki keeps the CA key beside it)."""
    d = pki.ca.parent
    key, csr, cert, ext = (d / f"{name}{s}" for s in (".key", ".csr", ".crt", ".cnf"))
    ext.write_text(
        f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"
    )
    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for args in (
        ("req", "-new", *curve, "-keyout", key, "-out", csr, "-subj", f"/CN={name}"),
        ("x509", "-req", "-in", csr, "-CA", pki.ca, "-CAkey", d / "ca.key",
         "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", ext),
    ):  # fmt: skip
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)
    return cert, key


def test_over_tls_a_replica_is_taken_only_from_a_certificate_naming_its_node(
    make_daemon: Any, tmp_path: Path
) -> None:
    """Each node has its own certificate (DNS:<node_id>); a daemon with a valid
    certificate of the same CA naming another node cannot send node-a's replica."""
    pki = make_pki(tmp_path / "pki")
    certs = {n: _issue(pki, n, f"IP:127.0.0.1,DNS:{n}") for n in (*NODES, "node-z")}
    env = {
        n: {
            "CKPTD_PEER_TLS_CERT_FILE": str(certs[n][0]),
            "CKPTD_PEER_TLS_KEY_FILE": str(certs[n][1]),
        }
        for n in NODES
    }
    cluster = Cluster(
        make_daemon, tmp_path, env=env, extra_args=["--peer-tls-ca-file", str(pki.ca)]
    )
    client = cluster.daemons["node-a"].client("job")
    client.save(3, state(3)).wait("local", 60)
    cluster.replicated("node-a", "job", 3)  # node-a's own certificate: taken
    cert, key = certs["node-z"]
    creds = grpc.ssl_channel_credentials(pki.ca.read_bytes(), key.read_bytes(), cert.read_bytes())
    address = f"127.0.0.1:{cluster.ports['node-b']}"
    with grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.PeerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.PutReplica(iter(_put_chunks(_forged("node-a"))), metadata=GOOD, timeout=30)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "certificate names" in err.value.details() and "node-z" in err.value.details()
        hello = stub.Hello(pb.PeerHelloRequest(), metadata=GOOD, timeout=30)
        # The bulk listener checks the same certificate.
        tls = PeerTls(str(cert), str(key), str(pki.ca))

        async def pieces() -> AsyncIterator[memoryview]:
            yield memoryview(DATA)

        request = {"job": "job", "step": FORGED_STEP, "manifest": _forged("node-a")}
        target = ("127.0.0.1", hello.data_port)
        with pytest.raises(Unavailable, match="certificate names"):
            asyncio.run(push(target, TOKEN, request, pieces, len(DATA), tls, "127.0.0.1"))
        held = stub.ListReplicas(pb.ListReplicasRequest(job="job"), metadata=GOOD, timeout=30)
    assert [(r.source_node, r.step) for r in held.replicas] == [("node-a", 3)]


def _store(tmp_path: Path) -> ReplicaStore:
    store = ReplicaStore(tmp_path, 10**6)
    store.load()
    return store


def _begin(store: ReplicaStore, step: int) -> Incoming:
    incoming = store.begin("j", step, _manifest(step, FILES))
    assert isinstance(incoming, Incoming)
    incoming.write(DATA)
    return incoming


def test_a_high_step_held_never_blocks_its_sources_later_replicas(tmp_path: Path) -> None:
    """The source's last replica replaces the one held whatever the numbers; of two
    received at once, the one begun later stays (it is the source's newer save)."""
    store = _store(tmp_path)
    _begin(store, FORGED_STEP).finish()
    assert _begin(store, 3).finish().step == 3
    assert [h.step for h in store.list()] == [3]
    assert not (tmp_path / ".replicas" / "j" / "src" / str(FORGED_STEP)).exists()
    first, second = _begin(store, 4), _begin(store, 5)
    assert second.finish().step == 5
    assert first.finish().step == 5  # began earlier: dropped, the later one stays
    assert [h.step for h in store.list()] == [5]
    assert list((tmp_path / ".replicas" / ".incoming").iterdir()) == []
    again = ReplicaStore(tmp_path, 10**6)
    assert again.load() == 1 and [h.step for h in again.list()] == [5]


class _Peers:
    """Peers as a daemon learnt them from ``Hello`` (the test's fake)."""

    def __init__(self, known: list[Peer], tls: object = None) -> None:
        self._known, self.tls, self.asked = known, tls, 0

    async def known(self, fresh: bool = False) -> list[Peer]:
        self.asked += fresh
        return self._known


def test_the_sender_check_by_address_and_by_certificate() -> None:
    peers = _Peers([Peer("node-a", "10.0.0.1:7000"), Peer("node-b", "[fd00::2]:7000")])
    check = SenderCheck("auto", peers)  # type: ignore[arg-type]
    assert check.mode == "address"

    def run(node: str, sender: Sender) -> None:
        asyncio.run(check.check(node, sender))

    run("node-a", Sender("10.0.0.1"))
    run("node-b", Sender("fd00::2"))
    run("node-a", Sender("::ffff:10.0.0.1"))  # a dual-stack listener's spelling
    with pytest.raises(PermissionDenied, match=r"node-a answers at 10\.0\.0\.1"):
        run("node-a", Sender("10.0.0.9"))
    assert peers.asked == 1  # asked afresh once (a replaced pod) before refusing
    with pytest.raises(PermissionDenied, match="no `peers` entry"):
        run("node-z", Sender("10.0.0.1"))
    shared = SimpleNamespace(server_name="ckptd-peer")  # one certificate for every node
    assert SenderCheck("auto", _Peers([], tls=shared)).mode == "address"  # type: ignore[arg-type]
    own = SimpleNamespace(server_name="")
    check = SenderCheck("auto", _Peers([], tls=own))  # type: ignore[arg-type]
    assert check.mode == "certificate"
    run("node-a", Sender("10.0.0.9", frozenset({"node-a", "10.0.0.9"})))
    with pytest.raises(PermissionDenied, match="certificate names ckptd-peer"):
        run("node-a", Sender("10.0.0.1", frozenset({"ckptd-peer"})))
    # gRPC's spelling of a caller (percent-encoded brackets in some versions).
    for peer, ip in (("ipv4:10.0.0.1:5", "10.0.0.1"), ("ipv6:%5B::1%5D:5", "::1")):
        context = SimpleNamespace(peer=lambda peer=peer: peer, auth_context=dict)
        assert grpc_sender(context) == Sender(ip)
    with pytest.raises(Exception, match="peer_identity"):
        SenderCheck("anyone", _Peers([]))  # type: ignore[arg-type]


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "peer-token"
    token.write_text(TOKEN)
    for mode, who in ((0o644, "its group and everyone"), (0o640, "its group"), (0o604, "everyone")):
        token.chmod(mode)
        with pytest.raises(InvalidArgument, match=f"readable by {who} .*chmod 600"):
            read_token(str(token))
    token.chmod(0o600)
    assert read_token(str(token)) == TOKEN
    # The daemon does not start, saying what to run.
    token.chmod(0o644)
    run_dir = short_tmpdir()  # a unix socket path has at most 107 bytes
    cfg = SimpleNamespace(root=tmp_path / "root", socket=run_dir / "ckptd.sock")
    out = subprocess.run(
        [CKPTD, "serve", "--root", str(cfg.root), "--socket", str(cfg.socket),
         "--node-id", "node-a", "--peer-address", "127.0.0.1:0", "--metrics-address", "off",
         "--peer-token-file", str(token)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    shutil.rmtree(run_dir, ignore_errors=True)
    assert out.returncode != 0, out.stderr
    assert f"chmod 600 {token}" in out.stderr and "Traceback" not in out.stderr


def test_a_replacement_takes_only_a_part_the_bucket_names_for_the_rank() -> None:
    """A node restoring a step the bucket holds (a replacement under a new name) asks
    every peer for any replica holding its rank: one of a node with no part of that
    step in the bucket is not taken, however many peers hold it."""
    from ckptd.daemon.catalog import Step
    from ckptd.daemon.peer.source import PeerSource

    real = _manifest(5, FILES, job="job", node="node-a")
    forged = _manifest(5, {"rank-00000.safetensors": DATA[::-1]}, job="job", node="node-c")
    b, c = Peer("node-b", "10.0.0.2:7000"), Peer("node-c", "10.0.0.3:7000")
    fetcher = PeerSource(SimpleNamespace(), SimpleNamespace(), SimpleNamespace(), SimpleNamespace())  # type: ignore[arg-type]
    taken: list[Any] = []

    async def replicas(job: str = "", source: str | None = None) -> Any:
        return {("job", 5): [(b, real, NO_OWNER), (b, forged, NO_OWNER), (c, forged, NO_OWNER)]}

    async def fetch(job: str, step: int, replica: Any, rank: int) -> None:
        taken.append(replica)

    fetcher.replicas = replicas  # type: ignore[method-assign]
    fetcher.fetch = fetch  # type: ignore[method-assign]
    st = Step("job", 5, remote_nodes=frozenset({"node-a"}))
    try:
        assert asyncio.run(fetcher.ensure_part(st, 0))
    finally:
        fetcher.close()
    assert [(r.text, r.peers) for r in taken] == [(real, [b])]
