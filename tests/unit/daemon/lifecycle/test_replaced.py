"""The drain takes a replaced save's copy out of the bucket (lifecycle/replaced.py),
over a ``file://`` bucket: once the save under its number is committed, without
waiting for its upload (which may never come), never while that save is still
being written, and not when it failed and gave the number back."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ckptd.daemon.catalog import Catalog
from ckptd.daemon.lifecycle.replaced import ReplacedCopies
from ckptd.daemon.remote.backends import open_remote
from ckptd.daemon.remote.index import Entry, NodeIndex
from ckptd.daemon.remote.layout import manifest_key, marker_key
from ckptd.proto import ckptd_pb2 as pb

from .manifests import NODE, manifest


def _world(tmp_path: Path) -> tuple[Catalog, NodeIndex, ReplacedCopies]:
    remote = open_remote(f"file://{tmp_path}/bucket", "", 2**20, 2)
    index = NodeIndex(remote, NODE)
    catalog = Catalog(NODE)

    async def upload_old() -> None:  # run A's step 2 (timeline 0), uploaded
        await remote.put_bytes(manifest_key("j", 2, NODE), manifest(2, 0).to_json().encode())
        await remote.put_bytes(marker_key("j", 2, NODE), b"")
        await index.add("j", Entry(2, timeline=0))

    asyncio.run(upload_old())
    assert catalog.discovered("j", 2, {NODE}, False, timeline=0) is not None
    return catalog, index, ReplacedCopies(catalog, remote, index)


def _in_bucket(index: NodeIndex) -> dict[int, int]:
    async def read() -> dict[int, int]:
        return {n: e.timeline for n, e in (await index.entries("j")).items()}

    return asyncio.run(read())


def test_the_older_copy_goes_once_the_save_under_its_number_is_committed(
    tmp_path: Path,
) -> None:
    catalog, index, replaced = _world(tmp_path)
    b = catalog.begin("j", 2, node_ranks=(0,), world_size=1, timeline=(1, ((1, 0),)))
    asyncio.run(replaced.run())  # still being written: it may fail and give it back
    assert _in_bucket(index) == {2: 0}
    catalog.committed(b, manifest(2, 1))
    asyncio.run(replaced.run())  # committed: out now, not at an upload that may not come
    assert _in_bucket(index) == {} and catalog.replaced_numbers("j") == {}
    assert catalog.discovered("j", 2, {NODE}, False, timeline=0) is None


def test_a_save_that_failed_gives_the_number_back_to_the_older_copy(tmp_path: Path) -> None:
    catalog, index, replaced = _world(tmp_path)
    b = catalog.begin("j", 2, node_ranks=(0,), world_size=1, timeline=(1, ((1, 0),)))
    catalog.failed(b, "the disk is full", "local")
    asyncio.run(replaced.run())
    assert _in_bucket(index) == {2: 0} and catalog.replaced_numbers("j") == {}
    assert [e.kind for e in catalog.events()][-1] == pb.STEP_EVENT_FAILED
