"""The peer tier with incremental steps (core/increments.py): a replica of one sends
only its own files, the new bytes, and the older steps it references first where
the peer lacks them; the peer keeps what its newest replica references; a node that
lost its disk takes a step back from the peers with the steps it references, so
its local tier holds them all, verified."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.core.manifest import MANIFEST, Manifest
from ckptd.core.verify import verify_step
from ckptd.daemon.peer.replicas import HOLDER_MARK
from ckptd.proto import ckptd_pb2 as pb

from .helpers import state_for
from .increment_helper import make_incremental
from .test_peer_tier import Cluster

KEEP = ["--retention-local", "KeepLatest(5)"]  # the local tier keeps the full step too


def _two_steps(
    make_daemon: Any, tmp_path: Path, b_down: bool = False, data_port: int = 0
) -> tuple[Cluster, Manifest, dict[str, bytes]]:
    """node-a saves full step 1, replicated to node-b (``b_down``: to node-c, node-b
    being down meanwhile), then holds step 2, incremental on step 1, once restarted
    (as a save would have committed it). node-c is down from then on: node-b is the
    one peer to send to (a refusal, as when a peer has not yet heard from node-a
    again, is then retried with node-b, not sent elsewhere)."""
    cluster = Cluster(make_daemon, tmp_path, extra_args=KEEP, data_port=data_port)
    a, b = cluster.daemons["node-a"], cluster.daemons["node-b"]
    if b_down:
        b.stop()
    a.client("job").save(1, state_for(1, 8)).wait("local", 60)
    cluster.replicated("node-a", "job", 1)
    if b_down:
        b.start()  # while node-a is up: it answers node-b's Hello
        assert _replicas(b) == [] and _replicas(cluster.daemons["node-c"]) == [1]
    cluster.daemons["node-c"].stop()
    a.stop()
    m, images = make_incremental(a.root, "job", 1, 2, change="w1")
    assert m.size_bytes < m.image_bytes // 2
    return cluster, m, images


def _replicas(d: Any) -> list[int]:
    root = d.root / ".replicas" / "job" / "node-a"
    return sorted(int(p.name) for p in root.iterdir()) if root.exists() else []


def test_an_incremental_step_sends_only_its_own_bytes(make_daemon: Any, tmp_path: Path) -> None:
    cluster, m, _ = _two_steps(make_daemon, tmp_path)
    a, b = cluster.daemons["node-a"], cluster.daemons["node-b"]
    before = b.status().peer_received_bytes
    assert before == _size(a.root, 1)
    a.start()
    cluster.replicated("node-a", "job", 2)
    # node-b held step 1 already: step 2's own file is all that went (counted where
    # it was taken: a send node-b refused before it heard from node-a is not).
    assert b.status().peer_received_bytes - before == m.size_bytes
    # node-b keeps step 1 beside step 2, which references it.
    assert b.status().replicas_held == 2 and _replicas(b) == [1, 2]
    assert b.status().replicas_held_bytes == m.size_bytes + _size(a.root, 1)


def _size(root: Path, step: int) -> int:
    return Manifest.from_json((root / "job" / str(step) / MANIFEST).read_text()).size_bytes


@pytest.mark.parametrize("data_port", [0, -1], ids=["bulk-listener", "grpc-only"])
def test_the_steps_referenced_go_first_to_a_peer_without_them(
    make_daemon: Any, tmp_path: Path, data_port: int
) -> None:
    cluster, m, _ = _two_steps(make_daemon, tmp_path, b_down=True, data_port=data_port)
    a, b = cluster.daemons["node-a"], cluster.daemons["node-b"]
    a.start()
    cluster.replicated("node-a", "job", 2)
    assert b.status().peer_received_bytes == m.size_bytes + _size(a.root, 1)
    assert b.status().replicas_held == 2 and _replicas(b) == [1, 2]
    # Step 1 came as step 2's holder (marked so), not as node-a's newest.
    held = b.root / ".replicas" / "job" / "node-a"
    assert (held / "1" / HOLDER_MARK).exists() and not (held / "2" / HOLDER_MARK).exists()
    # A full step replaces both: nothing references them any more.
    a.client("job").save(3, state_for(3, 8)).wait("local", 60)
    cluster.replicated("node-a", "job", 3)
    assert _replicas(b) == [3] and b.status().replicas_held == 1


def _lost_and_back(make_daemon: Any, tmp_path: Path) -> tuple[Cluster, Manifest, dict[str, bytes]]:
    cluster, m, images = _two_steps(make_daemon, tmp_path)
    a = cluster.daemons["node-a"]
    a.start()
    cluster.replicated("node-a", "job", 2)
    own = {r.file: (a.root / "job" / "2" / r.file).read_bytes() for r in m.ranks}
    cluster.lose("node-a").start()
    rows = {c.step: c for c in a.client("job").list()}  # waits for the pre-staging
    assert rows[2].tiers == ("LOCAL",) and rows[1].tiers == ("LOCAL",), rows
    step_dir = a.root / "job" / "2"
    assert {r.file: (step_dir / r.file).read_bytes() for r in m.ranks} == own
    assert verify_step(step_dir, m) == []  # its references read from step 1, local
    fetched = a.events_of(pb.STEP_EVENT_FETCHED, "job")
    assert sorted(e.step for e in fetched) == [1, 2]
    return cluster, m, images


def test_a_node_that_lost_its_disk_takes_back_a_step_with_the_steps_it_references(
    make_daemon: Any, tmp_path: Path
) -> None:
    _lost_and_back(make_daemon, tmp_path)


def test_an_incremental_step_taken_back_from_peers_restores_bit_exact(
    make_daemon: Any, tmp_path: Path
) -> None:
    cluster, _, _ = _lost_and_back(make_daemon, tmp_path)
    want = state_for(1, 8)
    want["w1"] = ~want["w1"].view(np.uint32)  # every byte inverted, as make_incremental did
    tree, _ = cluster.daemons["node-a"].client("job").restore(2)
    for key, value in want.items():
        assert np.asarray(tree[key]).tobytes() == value.tobytes(), key
