"""A removal from the bucket cut short (lifecycle/evictor.py, remote/retract.py), over
a ``file://`` bucket: the bucket goes away at a step's marker, or after it and before
its index entry goes. The step must leave view at once, stay out of view for the next
daemon on the node (its entry names a copy whose marker is gone), be refused to a
fetch, and be finished between the drain's uploads once the bucket is back
(lifecycle/replaced.py), without touching a later save's copy under its number."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from ckptd.core.errors import NotFound
from ckptd.daemon.catalog import Catalog
from ckptd.daemon.io import IoPool
from ckptd.daemon.lifecycle.evictor import Evictor
from ckptd.daemon.lifecycle.replaced import ReplacedCopies
from ckptd.daemon.local.admission import DiskSpace, Space, SpaceMark
from ckptd.daemon.local.prestaged import Prestaged
from ckptd.daemon.local.staging import Staging
from ckptd.daemon.local.store import LocalStore
from ckptd.daemon.remote.backends import open_remote
from ckptd.daemon.remote.base import Remote
from ckptd.daemon.remote.index import Entry, NodeIndex, index_key
from ckptd.daemon.remote.layout import manifest_key, marker_key
from ckptd.daemon.remote.own import learn_own
from ckptd.daemon.remote.source import BucketSource
from ckptd.daemon.retention.planner import Retention
from ckptd.daemon.retention.policies import KeepLatest

from .manifests import NODE, manifest


class Outage(OSError):
    """The bucket does not answer."""


def evictor(tmp_path: Path, catalog: Catalog, remote: Remote, index: NodeIndex) -> Evictor:
    store = LocalStore(tmp_path / "root")
    store.recover()
    disk = DiskSpace(
        tmp_path, SpaceMark.parse("1%"), SpaceMark.parse("1%"), lambda _: Space(2**40, 2**40)
    )
    retention = Retention(catalog, KeepLatest(3), KeepLatest(1))
    return Evictor(catalog, retention, store, disk, IoPool(1), remote, index)


async def two_steps_up(tmp_path: Path) -> tuple[Remote, Catalog, NodeIndex]:
    """Steps 0 and 1 of job ``j`` in a bucket, learnt by a daemon's catalog."""
    remote = open_remote(f"file://{tmp_path}/bucket", "", 2**20, 2)
    index = NodeIndex(remote, NODE)
    for n in (0, 1):
        await remote.put_bytes(manifest_key("j", n, NODE), manifest(n, 0).to_json().encode())
        await remote.put_bytes(marker_key("j", n, NODE), b"")
        await index.add("j", Entry(n))
    catalog = Catalog(NODE)
    await learn_own(catalog, index, "j")
    return remote, catalog, index


@pytest.mark.parametrize("cut", ["marker", "entry"])
def test_a_removal_cut_short_is_out_of_view_and_finished_at_the_next_pass(
    tmp_path: Path, cut: str
) -> None:
    """``cut``: the bucket goes away at the marker's delete (the entry flagged), or
    after it, at the entry's removal."""

    async def body() -> None:
        remote, catalog, index = await two_steps_up(tmp_path)
        ev = evictor(tmp_path, catalog, remote, index)
        real_put, real_delete = remote.put_bytes, remote.delete
        writes = 0

        async def put(key: str, data: bytes) -> None:
            nonlocal writes
            if key == index_key("j", NODE):
                writes += 1
                if writes > 1:  # the entry flagged; the bucket gone before it is removed
                    raise Outage("connection refused")
            await real_put(key, data)

        async def delete(keys: list[str]) -> None:
            if cut == "marker":
                raise Outage("connection refused")
            await real_delete(keys)

        remote.put_bytes = put  # type: ignore[method-assign]
        remote.delete = delete  # type: ignore[method-assign]
        await ev.run_once()
        assert await remote.exists(marker_key("j", 0, NODE)) == (cut == "marker")
        st = catalog.get("j", 0)
        assert st is None or not st.in_remote  # out of view in this daemon at once
        assert await remote.exists(manifest_key("j", 0, NODE))  # the copy half removed

        # The next daemon on the node (a restart, or a node loss): the entry is there,
        # flagged; it is not a copy, and no fetch of it starts.
        catalog2 = Catalog(NODE)
        index2 = NodeIndex(remote, NODE)
        assert set(await index2.entries("j")) == {0, 1}
        assert set(await learn_own(catalog2, index2, "j")) == {1}
        assert catalog2.get("j", 0) is None
        assert index2.retracting("j", 0) and not index2.retracting("j", 1)

        remote.put_bytes = real_put  # type: ignore[method-assign]
        remote.delete = real_delete  # type: ignore[method-assign]
        await ReplacedCopies(catalog2, remote, index2).run()
        assert not index2.retracting("j", 0)
        assert set(await NodeIndex(remote, NODE).entries("j")) == {1}
        assert not await remote.exists(manifest_key("j", 0, NODE))
        assert await remote.exists(marker_key("j", 1, NODE))

    asyncio.run(body())


def test_a_fetch_that_starts_while_a_step_is_retracted_is_refused(tmp_path: Path) -> None:
    """While this daemon removes a step, and while its entry stays flagged, a restore
    that picked the step from the listing just before gets NotFound, not a copy being
    deleted; once the removal stopped with nothing changed, it is served again."""

    async def body() -> None:
        remote, catalog, index = await two_steps_up(tmp_path)
        staging = Staging("ckptd-test-", 2**22, 600.0, shm_dir=tmp_path)
        store = LocalStore(tmp_path / "root")
        store.recover()
        source = BucketSource(catalog, store, Prestaged(staging, catalog), IoPool(1), remote, index)
        st = catalog.get("j", 0)
        assert st is not None and st.in_remote
        with index.removing("j", 0), pytest.raises(NotFound, match="retention is taking"):
            await source.to_local(st, 0, False)
        assert not index.retracting("j", 0)  # nothing was flagged: whole again
        await index.flag_retracting("j", 0)
        with pytest.raises(NotFound, match="retention is taking"):
            await source.to_local(st, 0, False)
        assert (await NodeIndex(remote, NODE).entries("j"))[0].retracting

    asyncio.run(body())


def test_a_failed_index_write_changes_nothing_the_daemon_knows(tmp_path: Path) -> None:
    """An index write that fails leaves the daemon's view as the bucket's: a flag, a
    removal or an addition that did not land is not believed (a later write would
    otherwise skip it, or leave a flag under a later save)."""

    async def body() -> None:
        remote, _, index = await two_steps_up(tmp_path)
        real_put = remote.put_bytes

        async def put(key: str, data: bytes) -> None:
            raise Outage("connection refused")

        remote.put_bytes = put  # type: ignore[method-assign]
        for call in (
            index.flag_retracting("j", 0),
            index.remove("j", 0),
            index.add("j", Entry(0, timeline=1, forks=((1, 0),))),
        ):
            with pytest.raises(Outage):
                await call
        remote.put_bytes = real_put  # type: ignore[method-assign]
        assert await index.entries("j") == await NodeIndex(remote, NODE).entries("j")
        assert not index.retracting("j", 0)
        await index.add("j", Entry(0, timeline=1, forks=((1, 0),)))  # written now, not skipped
        assert (await NodeIndex(remote, NODE).entries("j"))[0].timeline == 1

    asyncio.run(body())


def test_finishing_keeps_a_later_saves_copy_under_the_number(tmp_path: Path) -> None:
    """A flagged entry of timeline 0's step 0, and a marker of timeline 1's save under
    the number (its upload landed, the index write did not): finishing drops the
    entry and leaves the later save's marker and manifest."""

    async def body() -> None:
        remote, _, index = await two_steps_up(tmp_path)
        await index.flag_retracting("j", 0)
        later = manifest(0, 1).to_json().encode()
        await remote.put_bytes(manifest_key("j", 0, NODE), later)
        await remote.put_bytes(
            marker_key("j", 0, NODE), json.dumps({"timeline": 1, "forks": [[1, 0]]}).encode()
        )
        restarted = NodeIndex(remote, NODE)
        await restarted.entries("j")  # the job learnt (a listing, a restore, a save)
        await ReplacedCopies(Catalog(NODE), remote, restarted).run()
        assert set(await NodeIndex(remote, NODE).entries("j")) == {1}
        assert await remote.exists(marker_key("j", 0, NODE))
        assert await remote.get_bytes(manifest_key("j", 0, NODE)) == later

    asyncio.run(body())


def test_retention_takes_the_newest_step_out_of_the_bucket_first(tmp_path: Path) -> None:
    """Steps 0, 1 and 2 in the bucket, retention keeps 1: step 1 goes before step 0.
    An incremental step reads older steps' files, never newer ones, so whatever a pass
    cut short leaves (an outage, a kill) holds what it reads."""

    async def body() -> None:
        remote, catalog, index = await two_steps_up(tmp_path)
        await remote.put_bytes(manifest_key("j", 2, NODE), manifest(2, 0).to_json().encode())
        await remote.put_bytes(marker_key("j", 2, NODE), b"")
        await index.add("j", Entry(2))
        await learn_own(catalog, index, "j")
        ev = evictor(tmp_path, catalog, remote, index)
        real_delete, order = remote.delete, []

        async def delete(keys: list[str]) -> None:
            order.extend(n for n in (0, 1, 2) if marker_key("j", n, NODE) in keys)
            await real_delete(keys)

        remote.delete = delete  # type: ignore[method-assign]
        await ev.run_once()
        assert order == [1, 0]
        assert set(await NodeIndex(remote, NODE).entries("j")) == {2}

    asyncio.run(body())
