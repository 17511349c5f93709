"""After a node loss the drain matches a job against this node's index before its
first upload of it (lifecycle/drain.py), over a ``file://`` bucket: a step taken back
from a peer that holds only an older save under its number gives way to the later
save the bucket holds, instead of retracting it as the copy it replaced."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ckptd.daemon.catalog import Catalog
from ckptd.daemon.io import IoPool
from ckptd.daemon.lifecycle.drain import Drain
from ckptd.daemon.local.store import LocalStore
from ckptd.daemon.remote.backends import open_remote
from ckptd.daemon.remote.index import Entry, NodeIndex
from ckptd.daemon.remote.layout import manifest_key, marker_key
from ckptd.daemon.retention.planner import Retention
from ckptd.daemon.retention.policies import KeepLatest
from ckptd.proto import ckptd_pb2 as pb

from .manifests import NODE, manifest


def test_a_step_taken_back_from_a_peer_gives_way_to_the_buckets_later_save(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        bucket = f"file://{tmp_path}/bucket"
        remote = open_remote(bucket, "", 2**20, 2)
        before = NodeIndex(remote, NODE)  # the daemon before the loss: run B's step 0 up
        await remote.put_bytes(manifest_key("j", 0, NODE), manifest(0, 1).to_json().encode())
        await remote.put_bytes(marker_key("j", 0, NODE), b"")
        await before.add("j", Entry(0, timeline=1, forks=((1, 0),)))

        catalog = Catalog(NODE)  # the daemon after it, its disk new
        store = LocalStore(tmp_path / "root")
        store.recover()
        index = NodeIndex(remote, NODE)
        retention = Retention(catalog, KeepLatest(3), KeepLatest(3))
        drain = Drain(catalog, remote, index, store, IoPool(2), retention, 1.0)
        await drain.resume()  # no job known yet: nothing matched
        # The peer was down when run B saved step 0: it gave back run A's.
        st = catalog.peer_fetched(manifest(0, 0), "peer")
        assert st.state == pb.SAVE_STATE_LOCAL

        await drain._drain(st)

        entries = await NodeIndex(remote, NODE).entries("j")
        assert {n: e.timeline for n, e in entries.items()} == {0: 1}
        assert await remote.exists(marker_key("j", 0, NODE))
        now = catalog.get("j", 0)
        assert now is not None and now is not st and now.timeline == 1 and not now.local

    asyncio.run(body())
