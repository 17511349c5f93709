"""The peer tier: three daemons on 127.0.0.1 acting as three nodes (own roots,
sockets, TCP ports), one SeaweedFS bucket. A node that loses its disk takes its
newest step back from a peer, bit-exact, before the trainer asks; a peer that dies
mid-transfer, or every peer down, falls back; a wrong token is refused."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from ckptd.core.errors import Unavailable
from ckptd.core.wire import CHANNEL_OPTIONS
from ckptd.daemon.peer.bulk_client import read_range
from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import ckptd_pb2_grpc as pb_grpc

from .conftest import CKPTD, Daemon, RemoteTarget
from .servers import free_port
from .test_metrics import scrape, value
from .test_remote_tier import s3_target

NODES = ("node-a", "node-b", "node-c")
TOKEN = "0123456789abcdef0123456789abcdef"


def state(step: int, mib: int = 6) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal(mib * 2**18).astype(np.float32),
        "step": np.array(step, np.int64),
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in a:
        assert np.array_equal(np.asarray(a[key]), np.asarray(b[key])), key


class Cluster:
    """Three daemons that are each other's peers (a replica of each node's newest
    step goes to the next node by name)."""

    def __init__(
        self,
        make_daemon: Any,
        tmp_path: Path,
        remote: RemoteTarget | None = None,
        env: dict[str, dict[str, str]] | None = None,
        replicas: int = 1,
        data_port: int = 0,
        extra_args: list[str] | None = None,
        peer_host: str = "127.0.0.1",
    ) -> None:
        token = tmp_path / "peer-token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)  # a token others can read is refused at start-up
        self.ports = {n: free_port() for n in NODES}
        self.daemons: dict[str, Daemon] = {}
        for node in NODES:
            args = [
                "--node-id", node,
                "--peer-address", f"127.0.0.1:{self.ports[node]}",
                "--peers", ",".join(f"{peer_host}:{p}" for p in self.ports.values()),
                "--peer-token-file", str(token),
                "--retention-local", "KeepLatest(1)",
                "--peer-replicas", str(replicas),
                "--peer-data-port", str(data_port),
                *(extra_args or []),
            ]  # fmt: skip
            extra = dict((env or {}).get(node, {}))
            if remote is not None:
                args += ["--remote", remote.url, "--part-size-bytes", "5MiB"]
                extra.update(remote.env)
            self.daemons[node] = make_daemon(
                root=tmp_path / f"root-{node}", extra_args=args, env=extra
            )

    def replicated(self, node: str, job: str, step: int, timeout: float = 60.0) -> None:
        """Wait until ``node``'s ``step`` shows a replica on a peer (tier PEER)."""
        client = self.daemons[node].client(job)
        deadline = time.monotonic() + timeout
        while True:
            row = next((c for c in client.list() if c.step == step), None)
            if row is not None and "PEER" in row.tiers:
                return
            assert time.monotonic() < deadline, f"{node} {job}/{step}: {row}"
            time.sleep(0.05)

    def held(self, node: str, replicas: int, timeout: float = 60.0) -> None:
        """Wait until ``node`` holds ``replicas`` replicas for its peers."""
        deadline = time.monotonic() + timeout
        while self.daemons[node].status().replicas_held != replicas:
            assert time.monotonic() < deadline, self.daemons[node].status()
            time.sleep(0.05)

    def lose(self, node: str) -> Daemon:
        """The node dies with its disk; a replacement starts on an empty root."""
        d = self.daemons[node]
        d.kill()
        shutil.rmtree(d.root)
        return d


@pytest.fixture
def cluster(make_daemon: Any, tmp_path: Path) -> Cluster:
    return Cluster(make_daemon, tmp_path)


@pytest.mark.parametrize("data_port", [0, -1], ids=["bulk-listener", "grpc-only"])
def test_a_node_that_lost_its_disk_restores_from_a_peer_bit_exact(
    make_daemon: Any, tmp_path: Path, data_port: int
) -> None:
    """With the bulk listener (sendfile) and without one (-1: GetReplicaFile)."""
    cluster = Cluster(make_daemon, tmp_path, data_port=data_port)
    a = cluster.daemons["node-a"]
    client = a.client("job")
    saved = {}
    for step in (1, 2):
        saved[step] = state(step)
        client.save(step, saved[step]).wait("local", 60)
    cluster.replicated("node-a", "job", 2)
    replicated = a.events_of(pb.STEP_EVENT_REPLICATED, "job", 2)
    assert [dict(e.attributes) for e in replicated] == [{"nodes": "node-b"}]
    b = cluster.daemons["node-b"]
    held = b.status()
    assert held.replicas_held == 1 and held.replicas_held_bytes > 0
    # Taken: step 2's replica, and step 1's if it went before step 2 was local.
    assert held.peer_received_bytes >= held.replicas_held_bytes and held.peer_served_bytes == 0
    assert held.peer_address == f"127.0.0.1:{cluster.ports['node-b']}"
    assert (held.peer_data_port > 0) == (data_port == 0)
    # A restart with the disk intact sends the step again: node-b holds it already.
    a.stop()
    a.start()
    cluster.replicated("node-a", "job", 2)
    assert b.status().replicas_held == 1 and not a.status().peer_error

    cluster.lose("node-a").start()
    rows = {c.step: c for c in client.list()}
    assert rows[2].tiers == ("LOCAL",), rows  # pre-staged before the trainer asked
    # Into shared memory too (after the commit): the rank's restore hands over the
    # segment the whole file was staged in (offset 0), read from neither disk nor network.
    deadline = time.monotonic() + 60
    while a.status().peer_prestaged_bytes == 0:
        assert time.monotonic() < deadline, a.status()
        time.sleep(0.05)
    first = a.connection.restore(pb.RestoreRequest(job="job", rank=0, shared_memory=True))
    assert first.step == 2 and first.lease.lease_id and first.data_offset_in_file == 0
    a.connection.release_lease(pb.ReleaseLeaseRequest(lease_id=first.lease.lease_id))
    tree, _ = client.restore()
    same(tree, saved[2])
    fetched = a.events_of(pb.STEP_EVENT_FETCHED, "job", 2)
    assert [dict(e.attributes) for e in fetched] == [{"node": "node-b", "via": "peer"}]
    # node-b served the whole replica (status and metrics agree).
    assert b.status().peer_served_bytes == held.replicas_held_bytes
    samples = scrape(b)
    assert value(samples, "ckptd_peer_bytes_total", direction="served") == (
        held.replicas_held_bytes
    )
    received = value(samples, "ckptd_peer_bytes_total", direction="received")
    assert received == b.status().peer_received_bytes >= held.replicas_held_bytes


def test_a_wrong_token_is_refused(cluster: Cluster) -> None:
    port = cluster.ports["node-b"]
    stub = pb_grpc.PeerStub(grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS))
    for metadata in ((), (("authorization", "Bearer not-the-token-at-all"),)):
        with pytest.raises(grpc.RpcError) as err:
            stub.ListReplicas(pb.ListReplicasRequest(), metadata=metadata, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "peer_token_file" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.PutReplica(
                iter([pb.ReplicaChunk(job="j", step=1, manifest_json="{}")]),
                metadata=metadata,
                timeout=10,
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    good = (("authorization", f"Bearer {TOKEN}"),)
    hello = stub.Hello(pb.PeerHelloRequest(), metadata=good, timeout=10)
    assert hello.node == "node-b" and hello.data_port > 0
    # The bulk listener asks for the same token before it reads a file.
    with pytest.raises(Unavailable, match="peer_token_file"):
        read_range(
            ("127.0.0.1", hello.data_port),
            "not-the-token-at-all",
            {"job": "job", "source": "node-a", "step": 1,
             "file": "rank-00000.safetensors", "offset": 0, "length": 1},
            memoryview(bytearray(16)),
            lambda piece: None,
        )  # fmt: skip
    with pytest.raises(grpc.RpcError) as err:  # the right token, a bad replica
        stub.PutReplica(
            iter([pb.ReplicaChunk(job="../x", step=1, manifest_json="{}")]),
            metadata=good,
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_peer_dying_mid_transfer_hands_over_to_the_next_peer(
    make_daemon: Any, tmp_path: Path
) -> None:
    cluster = Cluster(
        make_daemon,
        tmp_path,
        env={"node-b": {"CKPTD_FAILPOINTS": "peer.serve_chunk=pause"}},
        replicas=2,
    )
    a, b = cluster.daemons["node-a"], cluster.daemons["node-b"]
    client = a.client("job")
    saved = state(7)
    client.save(7, saved).wait("local", 60)
    cluster.held("node-b", 1)
    cluster.held("node-c", 1)
    cluster.lose("node-a").start()  # pre-staging asks node-b first (by name)
    b.wait_failpoint("peer.serve_chunk")  # one chunk sent
    b.kill()
    tree, _ = client.restore()  # waits for the pre-staging, which node-c finished
    same(tree, saved)
    fetched = a.events_of(pb.STEP_EVENT_FETCHED, "job", 7)
    assert [dict(e.attributes) for e in fetched] == [{"node": "node-c", "via": "peer"}]
    assert "node-b" in a.status().peer_error


def test_with_every_peer_gone_the_bucket_restores(
    make_daemon: Any, tmp_path: Path, s3_server: Any
) -> None:
    remote = s3_target(s3_server, "peer-fallback")
    cluster = Cluster(
        make_daemon,
        tmp_path,
        remote,
        env={"node-b": {"CKPTD_FAILPOINTS": "peer.serve_chunk=pause"}},
    )
    a, b, c = (cluster.daemons[n] for n in NODES)
    client = a.client("job")
    saved = state(3)
    client.save(3, saved).wait("durable", 60)
    cluster.held("node-b", 1)
    c.kill()
    cluster.lose("node-a").start()
    b.wait_failpoint("peer.serve_chunk")  # the one holder dies mid-transfer
    b.kill()
    tree, _ = client.restore()
    same(tree, saved)
    fetched = a.events_of(pb.STEP_EVENT_FETCHED, "job", 3)
    assert len(fetched) == 1 and fetched[0].attributes["via"] != "peer"
    assert fetched[0].attributes["node"] == "node-a"  # its own part, from the bucket


def test_a_replacement_under_a_new_name_restores_its_predecessors_part_from_a_peer(
    make_daemon: Any, tmp_path: Path
) -> None:
    """Kubernetes names a replacement node anew (CKPTD_NODE_ID: spec.nodeName): it has
    no replicas of its own, but the part it restores (its predecessor's, which the
    bucket names) comes from the peer holding a replica of it, not the bucket."""
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    cluster = Cluster(make_daemon, tmp_path, remote)
    client = cluster.daemons["node-a"].client("job")
    saved = state(5)
    client.save(5, saved).wait("durable", 60)
    cluster.replicated("node-a", "job", 5)
    cluster.lose("node-a")
    d = make_daemon(
        root=tmp_path / "root-node-d",
        extra_args=[
            "--node-id", "node-d",
            "--peer-address", f"127.0.0.1:{free_port()}",
            "--peers", ",".join(f"127.0.0.1:{p}" for p in cluster.ports.values()),
            "--peer-token-file", str(tmp_path / "peer-token"),
            "--remote", remote.url,
        ],
    )  # fmt: skip
    tree, _ = d.client("job").restore()
    same(tree, saved)
    fetched = d.events_of(pb.STEP_EVENT_FETCHED, "job", 5)
    assert [dict(e.attributes) for e in fetched] == [{"node": "node-b", "via": "peer"}]


def test_ckptd_prefetch_makes_the_newest_step_local_before_the_trainer_asks(
    make_daemon: Any, tmp_path: Path
) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    d = make_daemon(extra_args=["--remote", remote.url, "--node-id", "solo"])
    client = d.client("job")
    saved = state(4, mib=1)
    client.save(4, saved).wait("durable", 60)
    d.kill()
    shutil.rmtree(d.root)
    d.start()

    def prefetch(job: str) -> subprocess.CompletedProcess[str]:
        cmd = [CKPTD, "prefetch", job, "--socket", str(d.socket)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    out = prefetch("job")
    assert out.returncode == 0 and "job/4: local (fetched from the bucket" in out.stdout, out
    assert client.list()[0].tiers == ("LOCAL", "REMOTE")
    out = prefetch("job")
    assert out.returncode == 0 and "(it was already" in out.stdout, out
    same(client.restore()[0], saved)
    out = prefetch("nojob")
    assert (
        out.returncode != 0
        and out.stderr.startswith("ckptd: error: ")
        and "Traceback" not in out.stderr
    )
