"""Another node's incremental part, fetched from the bucket for a resharding restore:
its holders' parts come with it, and the client reads referenced shards there."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client.shards import ShardReader

from .conftest import Daemon, RemoteTarget
from .test_incremental_readers import incremental  # noqa: F401
from .test_remote_tier import remote_daemon

pytestmark = pytest.mark.usefixtures("incremental")  # every save asks for an increment


def state(rank: int, step: int) -> dict[str, np.ndarray]:
    """Each rank its own keys; ``b`` changes from step to step, ``a`` does not."""
    rng = np.random.default_rng(rank)
    a = rng.standard_normal(30_000).astype(np.float32)
    return {f"a{rank}": a, f"b{rank}": np.full(5_000, step + rank, np.int64)}


def test_other_nodes_incremental_part_reads_from_its_holders_part(
    make_daemon: Any,
    tmp_path: Path,
) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemons: dict[str, Daemon] = {}
    for rank, name in enumerate(("node-a", "node-b")):
        # No eviction under disk pressure: a busy test machine's disk must not take
        # node-a's own step 1 (which its step 2 references) away mid-test.
        args = ["--node-id", name, "--local-low-watermark", "0%"]
        d = remote_daemon(make_daemon, remote, extra_args=args)
        c = d.client("peers", rank=rank, node_ranks=[rank], world_size=2)
        for step in (1, 2):
            c.save(step, state(rank, step)).wait("durable", 60)
        daemons[name] = d
    b_manifest = json.loads((daemons["node-b"].root / "peers" / "2" / "manifest.json").read_text())
    assert {r[2] for r in b_manifest["ranks"][0]["refs"]} == {1}

    client = daemons["node-a"].client("peers", rank=0, node_ranks=[0], world_size=2)
    peers = client.low_level.fetch_peers(2)
    [part] = peers.parts
    assert part.node == "node-b"
    directory = Path(part.directory)
    holder = directory.parent.parent / "1" / "node-b"
    assert (holder / "rank-00001.safetensors").is_file()
    # The daemon hands over the holder's files as it does the part's.
    session = client.connection.session
    os.close(session.open_file(str(holder / "rank-00001.safetensors")))

    mine = daemons["node-a"].root / "peers" / "2"
    mine_manifest = json.loads((mine / "manifest.json").read_text())
    reader = ShardReader(str(mine), mine_manifest, client.low_level.open_readable)
    reader.add_part(str(directory), json.loads(part.manifest_json), part=True)
    try:
        for key, want in {**state(0, 2), **state(1, 2)}.items():
            got = reader.assemble(key, [(0, n) for n in want.shape], want.dtype)
            assert got.tobytes() == want.tobytes(), key
    finally:
        reader.close()
