"""save -> wait("local") -> restore against a real daemon: bits, structure, metadata, files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import google_crc32c
import grpc
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from ckptd.client import CheckpointCorrupt, CheckpointNotFound
from ckptd.client.handoff import lease_size
from ckptd.core.format import round_up
from ckptd.core.shard_table import rows
from ckptd.daemon.local.segments import SEGMENT_GRANULE
from ckptd.proto import ckptd_pb2 as pb

from .conftest import META, Daemon
from .helpers import flip_byte, state_for

RNG = np.random.default_rng(7)

NUMPY_DTYPES = [
    "?",
    "i1",
    "i2",
    "i4",
    "i8",
    "u1",
    "u2",
    "u4",
    "u8",
    "f2",
    "f4",
    "f8",
    "g",
    "c8",
    "c16",
    "G",
    ">i4",
    ">f8",
    ">c16",
    "M8[ns]",
    "m8[s]",
    "S7",
    "U5",
    "V6",
]
ML_DTYPES = sorted(
    name
    for name in dir(ml_dtypes)
    if name.startswith(("float8", "float4", "float6", "bfloat16", "int2", "int4", "uint2", "uint4"))
    and isinstance(getattr(ml_dtypes, name), type)
)


def random_array(dt: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Random bits of ``dt`` (every byte pattern, including NaN payloads)."""
    raw = RNG.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    if dt.kind in "biu" and dt.itemsize == 1 and dt.name == "bool":
        return (raw % 2).astype(bool).reshape(shape)
    if dt.kind == "b":
        return (raw % 2).astype(dt).reshape(shape)
    return raw.view(dt).reshape(shape)


def assert_bits_equal(a: Any, b: Any) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_bits_equal(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_bits_equal(x, y)
    elif isinstance(a, np.ndarray | np.generic):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    else:
        assert a == b or (a != a and b != b)


def all_dtype_tree() -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name in NUMPY_DTYPES + ML_DTYPES:
        dt = np.dtype(getattr(ml_dtypes, name)) if name in ML_DTYPES else np.dtype(name)
        tree[name] = {
            "matrix": random_array(dt, (3, 5)),
            "scalar0d": random_array(dt, ()),
            "empty": random_array(dt, (0, 4)),
        }
    tree["structured"] = np.array(
        [(1, 2.5, b"ab"), (3, -1.0, b"cd")], dtype=[("a", "<i4"), ("b", "<f8"), ("c", "S2")]
    )
    tree["noncontiguous"] = np.arange(40, dtype=np.int32).reshape(5, 8)[:, ::3]
    tree["fortran"] = np.asfortranarray(RNG.standard_normal((4, 6)))
    return tree


def test_every_dtype_round_trips_bit_exact(daemon: Daemon) -> None:
    client = daemon.client("dtypes")
    tree = all_dtype_tree()
    client.save(1, tree).wait("local", timeout=60)
    restored, meta = client.restore()
    assert meta == {}
    assert_bits_equal(tree, restored)


def test_nested_pytree_with_metadata_and_json_leaves(daemon: Daemon) -> None:
    client = daemon.client("nested")
    tree = {
        "params": {
            "layers": [
                {
                    "w": RNG.standard_normal((8, 8)).astype(np.float32),
                    "b": np.zeros(8, ml_dtypes.bfloat16),
                }
                for _ in range(3)
            ]
        },
        "opt": ({"mu": np.ones(4)}, {"nu": np.full(4, 2.0)}),
        "step": 12,
        "lr": 3e-4,
        "name": "adam",
        "done": False,
        "none": None,
        "rng": np.random.default_rng(3).bit_generator.state,  # 128-bit ints
        "scalar": np.float64(2.5),
        "int_scalar": np.int16(-3),
        7: "int key",
        "a/b": np.arange(3),
        "a.b": np.arange(4),
        "": np.arange(2),
        "nan": float("nan"),
    }
    meta = {"loss": 0.25, "epoch": 3, "tags": ["x", "y"]}
    h = client.save(5, tree, metadata=meta)
    h.wait("local", timeout=60)
    assert h.state() == "LOCAL"
    restored, got_meta = client.restore(step=5)
    assert got_meta == meta
    assert_bits_equal(tree, restored)
    assert isinstance(restored["scalar"], np.float64) and isinstance(restored["opt"], tuple)


def test_restored_arrays_are_writable_copy_on_write_views(daemon: Daemon) -> None:
    client = daemon.client("cow")
    client.save(1, {"w": np.arange(1000, dtype=np.float32)}).wait("local")
    first, _ = client.restore()
    first["w"][:] = -1  # in-place update like an optimizer step
    second, _ = client.restore()
    np.testing.assert_array_equal(second["w"], np.arange(1000, dtype=np.float32))


def test_shard_files_load_with_safetensors_and_crcs_match(daemon: Daemon) -> None:
    client = daemon.client("files")
    tree = {
        "f32": RNG.standard_normal((64, 33)).astype(np.float32),
        "i8": np.arange(-5, 5, dtype=np.int8),
        "bf16": np.ones((3, 3), ml_dtypes.bfloat16),
        "c128": np.array([1 + 2j, 3 - 4j]),
        "u16": np.arange(7, dtype=np.uint16),
        "flag": np.array([True, False]),
    }
    client.save(3, tree).wait("local")
    step_dir = daemon.root / "files" / "3"
    assert sorted(p.name for p in step_dir.iterdir()) == ["manifest.json", "rank-00000.safetensors"]
    manifest = json.loads((step_dir / "manifest.json").read_text())
    loaded = load_file(str(step_dir / "rank-00000.safetensors"))
    np.testing.assert_array_equal(loaded["f32"], tree["f32"])
    np.testing.assert_array_equal(loaded["i8"], tree["i8"])
    np.testing.assert_array_equal(loaded["u16"], tree["u16"])
    np.testing.assert_array_equal(loaded["flag"], tree["flag"])
    # dtypes numpy's safetensors loader lacks are stored as raw bytes, typed in the manifest
    assert loaded["bf16"].tobytes() == tree["bf16"].tobytes()
    assert loaded["c128"].tobytes() == tree["c128"].tobytes()
    data = (step_dir / "rank-00000.safetensors").read_bytes()
    assert manifest["ranks"][0]["crc32c"] == google_crc32c.value(data)  # what stores report
    assert manifest["ranks"][0]["size"] == len(data)
    assert manifest["job"] == "files" and manifest["step"] == 3 and manifest["node"] == "test-node"
    assert manifest["format_version"] == 2 and isinstance(manifest["shards"]["key"], list)
    shards = rows(manifest)
    assert {s["key"] for s in shards} == set(tree)
    for s in shards:
        chunk = data[s["offset"] : s["offset"] + s["length"]]
        assert google_crc32c.value(chunk) == s["crc32c"], s["key"]
        assert chunk == tree[s["key"]].tobytes()
        assert s["dtype"] in ("bfloat16", "<c16") or np.dtype(s["dtype"]) == tree[s["key"]].dtype
    # The header names the true dtype of the tensors safetensors holds as raw bytes.
    with safe_open(str(step_dir / "rank-00000.safetensors"), "np") as f:
        meta = f.metadata()
    assert meta["format"] == "ckptd"
    assert json.loads(meta["dtypes"]) == {"bf16": ["bfloat16", [3, 3]], "c128": ["<c16", [2]]}


def test_list_and_restore_newest_and_missing(daemon: Daemon) -> None:
    client = daemon.client("lst")
    for step in (1, 3, 5):
        client.save(step, {"x": np.full(4, step)}, metadata={"s": step}).wait("local")
    assert [c.step for c in client.list()] == [5, 3, 1]
    # Local only (no bucket); the newest is kept in memory too.
    assert all(c.state == "LOCAL" and c.tiers[-1:] == ("LOCAL",) for c in client.list())
    tree, meta = client.restore()
    assert meta == {"s": 5} and tree["x"][0] == 5
    # A save below the newest is the newest save (a new timeline): it is what comes back.
    client.save(4, {"x": np.full(4, 4)}, metadata={"s": 4}).wait("local")
    assert [(c.step, c.abandoned) for c in client.list()] == [
        (4, False),
        (3, False),
        (1, False),
        (5, True),
    ]
    assert client.restore()[1] == {"s": 4}
    with pytest.raises(CheckpointNotFound, match="no save of step 2"):
        client.restore(step=2)
    with pytest.raises(CheckpointNotFound, match="no restorable checkpoint"):
        daemon.client("never-saved").restore()


def test_restart_rescans_committed_steps(daemon: Daemon) -> None:
    client = daemon.client("rescan")
    client.save(2, {"x": np.arange(10)}, metadata={"m": 1}).wait("local")
    assert daemon.stop() == 0
    daemon.restart()
    tree, meta = daemon.client("rescan").restore()
    np.testing.assert_array_equal(tree["x"], np.arange(10))
    assert meta == {"m": 1}


@pytest.mark.parametrize("shared_memory", [True, False])
def test_flipped_byte_is_detected_and_never_served(
    disk_daemon: Daemon, shared_memory: bool
) -> None:
    client = disk_daemon.client("rot")
    client.save(1, {"x": np.arange(100, dtype=np.int64)}).wait("local")
    client.save(2, {"x": np.arange(100, dtype=np.int64) * 2}).wait("local")
    client.save(3, {"x": np.arange(100, dtype=np.int64) * 3}).wait("local")
    flip_byte(disk_daemon.root / "rot" / "3" / "rank-00000.safetensors")
    # the newest copy is corrupt: it is set aside and the newest intact one is served
    tree, _ = client.restore(shared_memory=shared_memory)
    np.testing.assert_array_equal(tree["x"], np.arange(100) * 2)
    assert [c.step for c in client.list()] == [2, 1]
    set_aside = disk_daemon.events_of(pb.STEP_EVENT_SET_ASIDE, "rot")
    assert [e.step for e in set_aside] == [3] and "x" in set_aside[0].detail
    assert len(list((disk_daemon.root / ".corrupt").iterdir())) == 1
    # asking for a corrupt step by number is an error, not a silent substitute
    flip_byte(disk_daemon.root / "rot" / "1" / "rank-00000.safetensors", where=-1)
    with pytest.raises(CheckpointCorrupt, match="step 1"):
        client.restore(step=1, shared_memory=shared_memory)
    assert [c.step for c in client.list()] == [2]


def test_restore_checks_every_chunk_and_the_header(disk_daemon: Daemon) -> None:
    """Restore checks the whole file's crc from chunks read and checksummed side by side:
    a flipped bit in a later chunk names its shard; one in the header's padding (no
    shard covers it) is caught too."""
    # Full files (the same state three times would otherwise be references to step 1).
    client = disk_daemon.client("chunks", incremental=False)
    state = state_for(0, 20)  # 20 MiB: three 8 MiB chunks
    for step in (1, 2, 3):
        client.save(step, state).wait("local")
    flip_byte(disk_daemon.root / "chunks" / "3" / "rank-00000.safetensors", where=4096 + 18 * 2**20)
    flip_byte(disk_daemon.root / "chunks" / "2" / "rank-00000.safetensors", where=4000)
    tree, _ = client.restore()
    np.testing.assert_array_equal(tree["w0"], state["w0"])
    assert [c.step for c in client.list()] == [1]
    details = {e.step: e.detail for e in disk_daemon.events_of(pb.STEP_EVENT_SET_ASIDE, "chunks")}
    assert "w3" in details[3] and "header or padding" in details[2]


def test_truncated_file_is_corrupt(disk_daemon: Daemon) -> None:
    client = disk_daemon.client("trunc")
    client.save(1, {"x": np.arange(5000, dtype=np.int64)}).wait("local")
    f = disk_daemon.root / "trunc" / "1" / "rank-00000.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 100)
    with pytest.raises(CheckpointCorrupt):
        client.restore(step=1)


def backing_file(arr: np.ndarray) -> str:
    """The file mapped at an array's address, from /proc/self/maps."""
    addr = arr.ctypes.data
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= addr < hi:
            return parts[5] if len(parts) > 5 else "(anonymous)"
    raise AssertionError("address not mapped")


def status(daemon: Daemon) -> pb.DaemonStatus:
    st: pb.DaemonStatus = daemon.stub().GetStatus(pb.GetStatusRequest(), metadata=META)
    return st


def test_restored_shared_memory_becomes_the_trainers_own(daemon: Daemon) -> None:
    client = daemon.client("lend")
    state = {"w": np.arange(2**20, dtype=np.float32)}
    client.save(1, state).wait("local")
    client.save(2, state).wait("local")  # the pool now has one free segment
    before = status(daemon)
    restored, _ = client.restore(step=1)  # shared-memory path: the pooled segment
    backing = backing_file(restored["w"])
    assert backing.startswith("/dev/shm/ckptd-") and backing.endswith("(deleted)"), backing
    after = status(daemon)
    # Handed over: no lease, and neither the pool nor the budget counts it any more.
    assert after.leases_held == 0
    segment = round_up(lease_size(4 * 2**20), SEGMENT_GRANULE)  # 4 MiB and the copy's word
    assert after.staging_allocated_bytes == before.staging_allocated_bytes - segment
    by_file, _ = client.restore(step=1, shared_memory=False)
    assert backing_file(by_file["w"]).endswith("/lend/1/rank-00000.safetensors")
    for step in range(3, 6):  # later saves never write into the trainer's memory
        client.save(step, {"w": np.full(2**20, -step, np.float32)}).wait("local")
    np.testing.assert_array_equal(restored["w"], np.arange(2**20, dtype=np.float32))
    restored["w"][:10] = 7  # writable, and private to the trainer
    again, _ = client.restore(step=1, shared_memory=False)
    np.testing.assert_array_equal(again["w"], np.arange(2**20, dtype=np.float32))
    assert status(daemon).leases_held == 0


def test_restored_arrays_kept_for_the_whole_run_never_hold_the_staging_budget(
    make_daemon: Any,
) -> None:
    # A budget of two 8 MiB saves: an optimizer that kept its restored state as views
    # used to hold one of them for good, and saves of the same size then waited.
    daemon = make_daemon(extra_args=["--staging-budget-bytes", "16MiB"])
    client = daemon.client("keep", staging_timeout=5)
    state = {"w": np.ones(2**21, np.float32)}
    client.save(1, state).wait("local")
    client.save(2, state).wait("local")
    kept = [client.restore(step=s)[0] for s in (1, 2)]  # both pooled segments taken
    for step in range(3, 8):
        client.save(step, state).wait("local")
    assert [float(k["w"][0]) for k in kept] == [1.0, 1.0]
    assert status(daemon).leases_held == 0


def test_only_restore_leases_can_be_held_by_the_client(daemon: Daemon) -> None:
    stub = daemon.stub()
    lease = stub.AcquireLease(pb.AcquireLeaseRequest(job="d", size_bytes=10), metadata=META)
    held = pb.ReleaseLeaseRequest(lease_id=lease.lease_id, client_holds=True)
    with pytest.raises(grpc.RpcError) as info:
        stub.ReleaseLease(held, metadata=META)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "not a restore lease" in (info.value.details() or "")


def test_many_saves_reuse_two_lease_segments(daemon: Daemon, tmp_path: Path) -> None:
    client = daemon.client("reuse")
    state = {"w": np.zeros(2**20, np.float32)}
    for step in range(6):
        state["w"] += 1
        client.save(step, state).wait("local")
    segs = [p for p in Path("/dev/shm").iterdir() if p.name.startswith("ckptd-")]
    st = status(daemon)
    # Two segments (4 MiB and the copy's word), reused in turn: the newest step kept
    # in one (the memory tier), the next save written into the other.
    assert st.staging_allocated_bytes == 2 * round_up(lease_size(4 * 2**20), SEGMENT_GRANULE)
    assert st.memory_tier_files == 1
    assert st.leases_held == 0 and len(segs) >= 1
    tree, _ = client.restore()
    assert float(tree["w"][0]) == 6.0


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_large_arrays_copied_in_parallel_chunks_exact(daemon: Daemon, copy_threads: int) -> None:
    client = daemon.client(f"big{copy_threads}", copy_threads=copy_threads)
    base = RNG.standard_normal((3000, 4000)).astype(np.float32)  # 48 MiB: split into chunks
    tree = {
        "c": base,
        "fortran": np.asfortranarray(base[:, :2500]),
        "strided": base[::2, ::3],
        "odd_rows": RNG.integers(0, 255, size=(7, 5_000_001), dtype=np.uint8),
    }
    client.save(1, tree).wait("local", timeout=120)
    restored, _ = client.restore()
    assert_bits_equal(tree, restored)


def test_a_commit_of_many_shards_is_checked_off_the_loop_and_restores(daemon: Daemon) -> None:
    from ckptd.daemon.local.records import INLINE_SHARDS

    client = daemon.client("many")
    state = {f"w{i:04d}": np.full(i % 7 + 1, i, np.int32) for i in range(INLINE_SHARDS + 44)}
    client.save(1, state).wait("local")
    restored, _ = client.restore(step=1)
    assert set(restored) == set(state)
    assert all(np.array_equal(restored[k], v) for k, v in state.items())
