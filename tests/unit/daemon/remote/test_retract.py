"""Taking a copy out of the bucket (remote/retract.py) against a ``file://`` bucket: a
daemon killed mid-way never leaves an index entry whose copy is half deleted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ckptd.daemon.remote.backends import open_remote
from ckptd.daemon.remote.index import Entry, NodeIndex
from ckptd.daemon.remote.layout import manifest_key, marker_key
from ckptd.daemon.remote.retract import delete_copy, retract_marker


class Killed(Exception):
    """The daemon died here."""


def test_a_retract_cut_short_leaves_no_entry_for_a_half_deleted_copy(tmp_path: Path) -> None:
    remote = open_remote(f"file://{tmp_path}/bucket", "", 2**20, 2)

    async def body() -> tuple[dict[int, Entry], bool]:
        index = NodeIndex(remote, "node-a")
        await remote.put_bytes(manifest_key("j", 2, "node-a"), b"{}")
        await remote.put_bytes(marker_key("j", 2, "node-a"), b"")
        await index.add("j", Entry(2))
        real_delete = remote.delete
        calls = 0

        async def delete(keys: list[str]) -> None:
            nonlocal calls
            calls += 1
            if calls > 1:  # the marker went; killed before the copy's objects do
                raise Killed
            await real_delete(keys)

        remote.delete = delete  # type: ignore[method-assign]
        await retract_marker(remote, index, "j", 2, "node-a", False)
        with pytest.raises(Killed):
            await delete_copy(remote, index, "j", 2, "node-a", False)
        after_restart = NodeIndex(remote, "node-a")
        return await after_restart.entries("j"), await remote.exists(manifest_key("j", 2, "node-a"))

    entries, manifest_left = asyncio.run(body())
    assert manifest_left  # the objects are still there (space, not a step)
    assert 2 not in entries  # and no entry names them
