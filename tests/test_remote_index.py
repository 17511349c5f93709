"""The node's step index in the bucket (daemon/remote/index.py, issue 18): what a daemon
reads instead of listing the bucket, kept in step with the markers, rebuilt for a
bucket written before it, and the other nodes' markers for a node that has none."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client import CheckpointNotFound, SaveHandle
from ckptd.core.manifest import Manifest, RankRecord, rank_file_name
from ckptd.daemon.remote import index, read
from ckptd.daemon.remote.layout import manifest_key, marker_key, ranks_key
from ckptd.proto import ckptd_pb2 as pb

from .conftest import CKPTD, RemoteTarget
from .helpers import state_for
from .test_remote_tier import remote_daemon
from .test_retention_tier import settled


def node_index(remote: RemoteTarget, job: str, node: str = "test-node") -> dict[int, Any]:
    """The node's index of ``job`` as the bucket holds it ({} when there is none)."""

    async def read(r: Any) -> dict[int, Any]:
        try:
            return index.decode(await r.get_bytes(index.index_key(job, node)))
        except FileNotFoundError:
            return {}

    found: dict[int, Any] = remote.run(read)
    return found


def test_the_index_follows_the_markers_and_a_bucket_without_one_still_restores(
    make_daemon: Any, remote: RemoteTarget
) -> None:
    daemon = remote_daemon(make_daemon, remote, extra_args=["--retention-remote", "KeepLatest(2)"])
    client = daemon.client("idx")
    for step in (1, 2, 3):
        client.save(step, state_for(step, 1), metrics={"loss": 1.0 / step}).wait("durable", 60)
    settled(client, [1, 2, 3], [2, 3])  # step 1 left the bucket: the index first
    entries = node_index(remote, "idx")
    assert sorted(entries) == [2, 3]
    # The daemon's health tag travels with the step's metrics (core/health.py).
    assert entries[3].metrics == {"loss": 1 / 3, "ckptd.nonfinite": 0.0}
    assert entries[3].created_unix > 0
    client.pin(2)
    assert node_index(remote, "idx")[2].pinned
    # A bucket written before the index (or whose index was lost): the node is lost too.
    remote.run(lambda r: r.delete([index.index_key("idx", "test-node")]))
    daemon.stop()
    shutil.rmtree(daemon.root)
    daemon.start()
    tree, _ = client.restore()
    assert tree["w0"].tobytes() == state_for(3, 1)["w0"].tobytes()
    del tree
    # Read the slow way once (step names, this node's markers), then written again.
    assert sorted(node_index(remote, "idx")) == [2, 3]
    assert [c.step for c in client.list()] == [3, 2]
    assert next(c for c in client.list() if c.step == 2).pinned  # the pin object


def test_jobs_only_in_the_bucket_are_read_when_asked_for(make_daemon: Any, tmp_path: Path) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon = remote_daemon(make_daemon, remote)
    for job in ("kept", "away"):
        daemon.client(job).save(7, state_for(7, 1)).wait("durable", 60)
    daemon.stop()
    shutil.rmtree(daemon.root / "away")  # this node holds "kept" only
    daemon.start()
    conn = daemon.client("kept").connection
    everything = conn.list_checkpoints(pb.ListCheckpointsRequest())
    assert {c.job for c in everything.checkpoints} == {"kept"}  # start-up read "kept" only
    away = daemon.client("away")
    assert [(c.step, c.tiers) for c in away.list()] == [(7, ("REMOTE",))]
    tree, _ = away.restore()
    assert tree["w1"].tobytes() == state_for(7, 1)["w1"].tobytes()
    del tree
    with pytest.raises(CheckpointNotFound):
        daemon.client("never").restore()


def test_a_node_under_a_new_name_restores_from_the_others_parts(
    make_daemon: Any, tmp_path: Path
) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    old = remote_daemon(make_daemon, remote, extra_args=["--node-id", "node-a"])
    client = old.client("moved")
    for step in (4, 5):
        client.save(step, state_for(step, 1)).wait("durable", 60)
    old.kill()  # node-a is gone; its replacement has another name and an empty disk
    new = remote_daemon(make_daemon, remote, extra_args=["--node-id", "node-b"])
    client = new.client("moved")
    assert [c.step for c in client.list()] == [5, 4]
    tree, _ = client.restore()
    assert tree["w2"].tobytes() == state_for(5, 1)["w2"].tobytes()
    del tree
    assert [e.step for e in new.events_of(pb.STEP_EVENT_FETCHED, "moved")] == [5]
    tree, _ = client.restore(step=4)
    assert tree["w2"].tobytes() == state_for(4, 1)["w2"].tobytes()
    del tree
    # node-b's own index names only what node-b itself uploads.
    assert node_index(remote, "moved", "node-b") == {}
    assert sorted(node_index(remote, "moved", "node-a")) == [4, 5]


def test_with_a_jitter_the_index_is_read_in_the_background(
    make_daemon: Any, tmp_path: Path
) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon = remote_daemon(make_daemon, remote, extra_args=["--remote-read-jitter-seconds", "0.5"])
    client = daemon.client("jit")
    client.save(1, {"x": np.arange(10)}).wait("durable", 60)
    client.save(2, {"x": np.arange(20)}).wait("local", 60)
    daemon.stop()
    daemon.start()
    tree, _ = client.restore()  # from the local tier: it needs nothing of the bucket
    assert tree["x"].tolist() == list(range(20))
    del tree
    SaveHandle(client, 2).wait("durable", 60)  # the drain goes on once the index is read
    assert sorted(node_index(remote, "jit")) == [1, 2]
    bad = subprocess.run(
        [CKPTD, "serve", "--remote-read-jitter-seconds", "-1", "--root", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "remote_read_jitter_seconds" in bad.stderr, bad.stderr


def test_a_rank_another_node_saved_is_found_in_one_listing_and_one_get(tmp_path: Path) -> None:
    """A replacement under a new name needs rank 15 of a step 10 nodes saved (2 ranks
    each): one listing of the step's records names the node holding it (its ranks
    record), and only that node's manifest is read; before the ranks records it read
    the manifests of the nodes in turn (up to 10)."""
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})

    async def body(r: Any) -> None:
        for i in range(10):
            node, ranks = f"n{i}", [2 * i, 2 * i + 1]
            records = [RankRecord(k, rank_file_name(k), 0, 0, None) for k in ranks]
            m = Manifest("j", 7, node, world_size=20, created_unix=0.0, ranks=records)
            await r.put_bytes(manifest_key("j", 7, node), m.to_json().encode())
            await r.put_bytes(ranks_key("j", 7, node, ranks), b"")
            if i != 3:  # n3's part is not complete: never a holder
                await r.put_bytes(marker_key("j", 7, node), b"{}")
        gets, lists = [], []
        get_bytes, list_keys = r.get_bytes, r.list_keys
        r.get_bytes = lambda key: gets.append(key) or get_bytes(key)
        r.list_keys = lambda prefix: lists.append(prefix) or list_keys(prefix)
        holders, complete = await read.rank_holders(r, "j", 7, 15)
        assert holders == ["n7"] and complete == {f"n{i}" for i in range(10)} - {"n3"}
        node, _, manifest = await read.node_manifest(r, "j", 7, {holders[0]}, 15, "x")
        assert node == "n7" and [k.rank for k in manifest.ranks] == [14, 15]
        assert (len(lists), len(gets)) == (1, 1)
        assert (await read.rank_holders(r, "j", 7, 7))[0] == []  # n3's: not complete

    remote.run(body)


def test_a_replacement_under_a_new_name_restores_the_rank_it_took_over(
    make_daemon: Any, tmp_path: Path
) -> None:
    """Two nodes save ranks 0 and 1 of a step; node-b is replaced by node-c, which
    restores rank 1 from node-b's part (found by its ranks record), bit-exact, and a
    step drained before the ranks records (the record deleted) still restores."""
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    nodes = {}
    for rank, name in enumerate(("node-a", "node-b")):
        d = remote_daemon(make_daemon, remote, extra_args=["--node-id", name])
        c = d.client("swap", rank=rank, node_ranks=[rank], world_size=2)
        for step in (4, 5):
            c.save(step, state_for(10 * step + rank, 1)).wait("durable", 60)
        nodes[name] = d
    for d in nodes.values():
        d.kill()

    async def drop_record(r: Any) -> None:  # step 4 as an older ckptd drained it
        await r.delete([ranks_key("swap", 4, "node-b", [1])])

    remote.run(drop_record)
    new = remote_daemon(make_daemon, remote, extra_args=["--node-id", "node-c"])
    client = new.client("swap", rank=1, node_ranks=[1], world_size=2)
    for step in (5, 4):
        tree, _ = client.restore(step=step)
        assert tree["w2"].tobytes() == state_for(10 * step + 1, 1)["w2"].tobytes()
        del tree
    fetched = new.events_of(pb.STEP_EVENT_FETCHED, "swap")
    assert [(e.step, e.attributes["node"]) for e in fetched] == [(5, "node-b"), (4, "node-b")]
