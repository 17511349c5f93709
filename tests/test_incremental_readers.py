"""Client readers of incremental rank files: a shard referenced from an older step's
file is read from there, checked, and the holder's directory is granted."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client import CheckpointCorrupt
from ckptd.client import saver as client_saver
from ckptd.client.mapped_views import Corrupt, build_tree, map_file_verified
from ckptd.client.rank_files import holder_dir
from ckptd.client.shards import CorruptShard, ShardReader
from ckptd.core.increments import file_offset
from ckptd.core.manifest import MANIFEST
from ckptd.core.shard_table import table_of
from ckptd.daemon.local.liveness import locked_by_others

from .conftest import Daemon
from .helpers import flip_byte

RANK0 = "rank-00000.safetensors"


@pytest.fixture
def incremental(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every save asks the daemon for an incremental step (the client does not yet)."""
    build = client_saver.Saver._commit_request

    def with_incremental(self: Any, *args: Any, **kw: Any) -> Any:
        req = build(self, *args, **kw)
        req.incremental = True
        return req

    monkeypatch.setattr(client_saver.Saver, "_commit_request", with_incremental)


def manifest_of(root: Path, job: str, step: int) -> dict[str, Any]:
    return json.loads((root / job / str(step) / MANIFEST).read_text())  # type: ignore[no-any-return]


def states() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Two states: ``a`` and ``c`` the same in both (referenced), ``b`` changed."""
    rng = np.random.default_rng(3)
    one = {
        "a": rng.standard_normal(20_000).astype(np.float32),
        "b": rng.standard_normal(3_000).astype(np.float64),
        "c": np.arange(50_000, dtype=np.int32),
    }
    return one, {**one, "b": one["b"] * 2 + 1}


def same(tree: dict[str, Any], want: dict[str, np.ndarray]) -> None:
    for k, v in want.items():
        got = np.asarray(tree[k])
        assert got.dtype == v.dtype and got.tobytes() == v.tobytes(), k


def saved_twice(daemon: Daemon, job: str) -> Any:
    """A client of ``job`` that saved ``states()`` as steps 1 and 2 (step 2
    references a and c from step 1)."""
    client = daemon.client(job)
    for step, state in enumerate(states(), 1):
        client.save(step, state).wait("local", 60)
    return client


def opener(path: str) -> int:
    return os.open(path, os.O_RDONLY)


def test_incremental_steps_restore_from_files_bit_exact(
    disk_daemon: Daemon, incremental: None
) -> None:
    client = saved_twice(disk_daemon, "inc")
    one, two = states()
    client.save(3, two).wait("local", 60)  # b now held by step 2, a and c still by 1
    root = disk_daemon.root
    r2, r3 = manifest_of(root, "inc", 2)["ranks"][0], manifest_of(root, "inc", 3)["ranks"][0]
    assert {ref[2] for ref in r2["refs"]} == {1} and {ref[2] for ref in r3["refs"]} == {1, 2}
    assert (root / "inc" / "3" / RANK0).stat().st_size < r3["image_size"]
    for step, want in ((3, two), (2, two), (1, one)):
        tree, _ = client.restore(step=step, shared_memory=False)
        same(tree, want)
    tree, _ = client.restore(shared_memory=False)
    same(tree, two)
    tree["a"][0] = 42.0  # the arrays are the caller's to update, not the files
    same(client.restore(step=3, shared_memory=False)[0], two)


def test_shards_are_viewed_in_the_files_that_hold_them(
    disk_daemon: Daemon, incremental: None
) -> None:
    """Nothing is copied: a referenced shard is a view of its holder's file, a changed
    one of the step's own (both mapped copy-on-write, as a full step's file)."""
    client = saved_twice(disk_daemon, "views")
    two = states()[1]
    tree, _ = client.restore(step=2, shared_memory=False)
    same(tree, two)
    maps = Path("/proc/self/maps").read_text()
    for step in (1, 2):
        assert f"{disk_daemon.root}/views/{step}/{RANK0}" in maps, step


def test_restored_arrays_hold_their_files_against_reuse(
    disk_daemon: Daemon, incremental: None
) -> None:
    """While arrays view a step's files, each is locked (shared) so the daemon never
    overwrites it as a spare; the lock goes with the arrays."""
    client = saved_twice(disk_daemon, "held")
    tree, _ = client.restore(step=2, shared_memory=False)
    files = [disk_daemon.root / "held" / str(step) / RANK0 for step in (1, 2)]

    assert all(locked_by_others(f) for f in files)
    del tree
    gc.collect()
    assert not any(locked_by_others(f) for f in files)


def test_a_corrupt_run_of_the_step_names_its_shard(disk_daemon: Daemon, incremental: None) -> None:
    saved_twice(disk_daemon, "own")
    root = disk_daemon.root
    manifest = manifest_of(root, "own", 2)
    record = manifest["ranks"][0]
    t = table_of(manifest).of_rank(0)
    i = t.keys.index("b")  # the one changed shard: in the step's own file
    start, length = int(t.offset[i]), int(t.length[i])
    path = root / "own" / "2" / RANK0
    flip_byte(path, where=file_offset(record["runs"], start, length) + length // 2)
    with pytest.raises(Corrupt, match=f"shard 'b' in {path}"):
        map_file_verified(str(root / "own" / "2"), manifest, 0, opener)


def test_runs_and_references_that_leave_a_gap_are_corrupt(tmp_path: Path) -> None:
    """Only a forged manifest could: commit checks them."""
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    (tmp_path / "1" / RANK0).write_bytes(bytes(8192))
    (tmp_path / "2" / RANK0).write_bytes(bytes(4096))
    record = {
        "rank": 0, "file": RANK0, "size": 4096, "image_size": 16384,
        "runs": [[0, 4096]], "refs": [[8192, 8192, 1, 0, 0]], "image_crc32c": 0,
    }  # fmt: skip
    manifest = {"step": 2, "ranks": [record]}
    with pytest.raises(Corrupt, match="do not hold image byte 4096 once"):
        map_file_verified(str(tmp_path / "2"), manifest, 0, opener)


def test_restore_grants_the_holders_directories(disk_daemon: Daemon, incremental: None) -> None:
    client = saved_twice(disk_daemon, "grant")
    client.restore(step=2, shared_memory=False)
    session = client.connection.session
    for step in (2, 1):  # the step's own file, and its holder's
        os.close(session.open_file(str(disk_daemon.root / "grant" / str(step) / RANK0)))


def test_a_corrupt_referenced_range_is_detected(disk_daemon: Daemon, incremental: None) -> None:
    client = disk_daemon.client("rot")
    zero = {k: np.zeros_like(v) for k, v in states()[0].items()}
    one, two = states()
    client.save(1, zero).wait("local", 60)
    client.save(2, one).wait("local", 60)  # in full: nothing as in step 1
    # In full too: step 2 changed every array, so step 3 is written without a scan.
    client.save(3, one).wait("local", 60)
    client.save(4, two).wait("local", 60)  # a and c referenced from step 3's file
    root = disk_daemon.root
    r4 = manifest_of(root, "rot", 4)["ranks"][0]
    ref = max(r4["refs"], key=lambda r: r[1])
    assert ref[2] == 3
    flip_byte(root / "rot" / "3" / RANK0, where=ref[3] + ref[1] // 2)

    # The file path names the holder's file and range.
    with pytest.raises(Corrupt, match=f"{root}/rot/3/{RANK0}"):
        map_file_verified(str(root / "rot" / "4"), manifest_of(root, "rot", 4), 0, opener)

    # Restore never serves those bytes: an older intact step, or CheckpointCorrupt.
    try:
        tree, _ = client.restore(shared_memory=False)
    except CheckpointCorrupt:
        return
    same(tree, one)
    assert [c.step for c in client.list()][-1] == 2  # steps 3 and 4 set aside


def test_holder_directories_beside_a_step_and_a_fetched_part() -> None:
    assert holder_dir("/r/job/7", 3) == "/r/job/3"
    assert holder_dir("/r/job/7/", 3) == "/r/job/3"
    assert holder_dir("/r/.peers/job/7/node-b", 3, part=True) == "/r/.peers/job/3/node-b"


def test_shard_reader_reads_referenced_shards_from_the_holder(
    disk_daemon: Daemon, incremental: None
) -> None:
    """Other ranks' shards (resharding, other nodes' parts) are read shard by shard."""
    saved_twice(disk_daemon, "shards")
    two = states()[1]
    root = disk_daemon.root
    manifest = manifest_of(root, "shards", 2)
    assert manifest["ranks"][0]["refs"]
    reader = ShardReader(str(root / "shards" / "2"), manifest)
    try:
        for key, want in two.items():
            got = reader.assemble(key, [(0, n) for n in want.shape], want.dtype)
            assert got.tobytes() == want.tobytes(), key
    finally:
        reader.close()
    ref = next(r for r in manifest["ranks"][0]["refs"] if r[1] >= 4096)
    flip_byte(root / "shards" / "1" / RANK0, where=ref[3] + 1)
    reader = ShardReader(str(root / "shards" / "2"), manifest)
    try:
        with pytest.raises(CorruptShard, match=f"{root}/shards/1/{RANK0}"):
            for key, want in two.items():
                reader.assemble(key, [(0, n) for n in want.shape], want.dtype)
    finally:
        reader.close()


def test_a_missing_or_short_holder_is_corrupt(disk_daemon: Daemon, incremental: None) -> None:
    saved_twice(disk_daemon, "gone")
    two = states()[1]
    root = disk_daemon.root
    manifest = manifest_of(root, "gone", 2)
    (root / "gone" / "1" / RANK0).rename(root / "gone" / "1" / "moved")
    with pytest.raises(Corrupt, match="is missing"):
        map_file_verified(str(root / "gone" / "2"), manifest, 0, opener)
    (root / "gone" / "1" / "moved").rename(root / "gone" / "1" / RANK0)
    mm = map_file_verified(str(root / "gone" / "2"), manifest, 0, opener)
    same(build_tree(mm, manifest, 0)[0], two)
    holder = root / "gone" / "1" / RANK0
    with open(holder, "r+b") as f:  # cut short inside the last referenced range
        f.truncate(max(r[3] + r[1] for r in manifest["ranks"][0]["refs"]) - 1)
    with pytest.raises(Corrupt, match=f"{holder} ends at byte"):
        map_file_verified(str(root / "gone" / "2"), manifest, 0, opener)
