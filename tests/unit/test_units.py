"""Unit tests of the pure parts: layout, dtypes, tree specs, names, config, leases."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
from pathlib import Path

import google_crc32c
import ml_dtypes
import numpy as np
import pytest

from ckptd.client.tree.spec import flatten, unflatten
from ckptd.core.errors import InvalidArgument, NotFound, ResourceExhausted
from ckptd.core.format import (
    ALIGN,
    TensorEntry,
    build_header_columns,
    dtype_to_str,
    plan_layout,
    round_up,
    str_to_dtype,
)
from ckptd.core.names import check_name, check_shard_key, check_step
from ckptd.core.shard_table import ShardTable
from ckptd.core.shard_wire import decode, encode
from ckptd.daemon.app import config
from ckptd.daemon.local.admission import parse_size
from ckptd.daemon.local.staging import Staging
from ckptd.daemon.local.store import LocalStore


@pytest.mark.parametrize(
    "dt", ["<f4", ">i8", "bfloat16", "float8_e4m3fn", "<U3", "|S5", "<M8[ns]", "<c16"]
)
def test_dtype_names_round_trip(dt: str) -> None:
    d = np.dtype(getattr(ml_dtypes, dt)) if hasattr(ml_dtypes, dt) else np.dtype(dt)
    assert str_to_dtype(dtype_to_str(d)) == d


def test_structured_dtype_round_trips_and_objects_refused() -> None:
    d = np.dtype([("a", "<i4"), ("b", "<f8", (2,))])
    assert str_to_dtype(dtype_to_str(d)) == d
    with pytest.raises(TypeError, match="object"):
        dtype_to_str(np.dtype(object))
    with pytest.raises(ValueError, match="unknown dtype"):
        str_to_dtype("float99")


def test_layout_is_packed_and_aligned() -> None:
    items = [
        ("a", np.dtype("u1"), (3,)),
        ("b", np.dtype("<f8"), (5,)),
        ("c", np.dtype("<f2"), (3,)),
        ("d", np.dtype("<c16"), (1,)),
    ]
    entries = plan_layout(items)
    assert table_of(entries).check_layout() == 3 + 40 + 6 + 16
    for e in entries:
        assert e.offset % e.dtype.alignment == 0
    assert [e.key for e in entries][-1] == "a"  # 1-byte items last


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        (
            [
                TensorEntry("a", np.dtype("<f4"), (2,), 0, 8),
                TensorEntry("b", np.dtype("<f4"), (1,), 12, 4),
            ],
            "holes",
        ),
        (
            [
                TensorEntry("a", np.dtype("<f4"), (2,), 0, 8),
                TensorEntry("a", np.dtype("<f4"), (1,), 8, 4),
            ],
            "duplicate",
        ),
        ([TensorEntry("a", np.dtype("<f4"), (2,), 0, 9)], "length 9"),
        (
            [
                TensorEntry("a", np.dtype("u1"), (1,), 0, 1),
                TensorEntry("b", np.dtype("<f4"), (1,), 1, 4),
            ],
            "aligned",
        ),
    ],
)
def test_check_layout_rejects(entries: list[TensorEntry], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        table_of(entries).check_layout()


def table_of(entries: list[TensorEntry]) -> ShardTable:
    """Entries as the daemon receives them: encoded by the client, decoded and checked."""
    return decode(encode(entries, {e.key: dtype_to_str(e.dtype) for e in entries}, {}))


def header_of(entries: list[TensorEntry], meta: dict[str, str]) -> bytes:
    t = ShardTable.from_plain(
        {
            "key": [e.key for e in entries],
            "dtype": [dtype_to_str(e.dtype) for e in entries],
            "ndim": [len(e.shape) for e in entries],
            "shape": [d for e in entries for d in e.shape],
            "global_shape": [d for e in entries for d in e.shape],
            "start": [0 for e in entries for _ in e.shape],
            "offset": [e.offset for e in entries],
            "length": [e.length for e in entries],
            "rank": [0] * len(entries),
            "crc32c": [0] * len(entries),
        }
    )
    off, n = t.offset.tolist(), t.length.tolist()
    return build_header_columns(t.keys, t.dtypes, t.dims(t.shape), off, n, lambda raw: meta)


def test_header_is_page_padded_valid_safetensors_json() -> None:
    entries = plan_layout(
        [("w", np.dtype("<f4"), (2, 2)), ("z", np.dtype(ml_dtypes.bfloat16), (3,))]
    )
    header = header_of(entries, {"k": "v"})
    assert len(header) % ALIGN == 0
    n = int.from_bytes(header[:8], "little")
    body = json.loads(header[8 : 8 + n])
    assert body["w"] == {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    assert body["z"]["dtype"] == "U8" and body["z"]["shape"] == [6]


def test_tree_spec_round_trip_and_keys() -> None:
    tree = {"a": [np.arange(2), (1, "x")], 3: {"b/c": np.ones(1), "b_c": np.zeros(1)}, "n": None}
    spec, arrays = flatten(tree)
    keys = [k for k, _ in arrays]
    assert len(set(keys)) == len(keys) and all("/" not in k and ".." not in k for k in keys)
    back = unflatten(json.loads(json.dumps(spec)), dict(arrays))
    assert back[3]["b/c"][0] == 1 and back["a"][1] == (1, "x") and back["n"] is None
    with pytest.raises(TypeError, match=r"\['a'\]\[1\].*set"):
        flatten({"a": [1, {1, 2}]})
    with pytest.raises(TypeError, match="dict key"):
        flatten({(1, 2): 3})


@pytest.mark.parametrize(
    "bad", ["", "a/b", "..", "a..b", "x\x00", "\x07", "a\\b", ".hidden", "n" * 256]
)
def test_bad_names_rejected(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        check_name("job", bad)


def test_good_names_and_steps() -> None:
    assert check_name("job", "run-42_v1.2") == "run-42_v1.2"
    assert check_shard_key("params.layer0.w~1") == "params.layer0.w~1"
    with pytest.raises(InvalidArgument):
        check_shard_key("__metadata__")
    with pytest.raises(InvalidArgument):
        check_step(-5)
    assert check_step(0) == 0


def test_config_precedence_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "ckptd.toml"
    f.write_text('root = "/file/root"\nstaging_budget_bytes = "1GiB"\nwrite_workers = 3\n')
    cfg = config.load(
        f,
        env={"CKPTD_STAGING_BUDGET_BYTES": "2GiB", "CKPTD_NODE_ID": "n1"},
        flags={"write_workers": "4", "root": None},
    )
    assert cfg.root == Path("/file/root")
    assert cfg.staging_budget_bytes == 2 * 2**30
    assert cfg.write_workers == 4 and cfg.node_id == "n1"


@pytest.mark.parametrize(
    ("text", "env", "match"),
    [
        (
            "staging_budget = 5\n",
            {},
            "unknown config key 'staging_budget'.*did you mean 'staging_budget_bytes'",
        ),
        ('staging_budget_bytes = "lots"\n', {}, "'staging_budget_bytes' from config file"),
        ("write_workers = 0\n", {}, "'write_workers'.*positive"),
        ("root = \n", {}, "not valid TOML"),
        (
            "",
            {"CKPTD_LEASE_TIMEOUT_SECONDS": "soon"},
            "environment variable CKPTD_LEASE_TIMEOUT_SECONDS",
        ),
        ("", {"CKPTD_NODE_ID": "a/b"}, "'node_id'"),
        ("", {"CKPTD_LOG_LEVEL": "loud"}, "'log_level'"),
    ],
)
def test_config_errors_name_the_key(
    tmp_path: Path, text: str, env: dict[str, str], match: str
) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(config.ConfigError, match=match):
        config.load(f, env=env)


def test_config_sizes() -> None:
    assert parse_size("512 MiB") == 512 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size(4096) == 4096
    with pytest.raises(ValueError):
        parse_size("12 parsecs")


def test_staging_reuses_segments_and_enforces_budget(tmp_path: Path) -> None:
    now = [0.0]
    st = Staging("ckptd-test-", 8 * 2**20, 10.0, shm_dir=tmp_path, clock=lambda: now[0])

    async def scenario() -> None:
        a = await st.acquire("j", 3 * 2**20)
        assert a.segment.size == 4 * 2**20
        b = await st.acquire("j", 2**20)
        assert st.allocated_bytes == 6 * 2**20
        with pytest.raises(ResourceExhausted, match="budget exhausted"):
            await st.acquire("j", 3 * 2**20)
        st.release(a.lease_id)
        c = await st.acquire("j", 3 * 2**20)
        assert c.segment is a.segment  # reused, not reallocated
        st.release(c.lease_id)
        st.release(b.lease_id)
        d = await st.acquire("j", 7 * 2**20)  # frees the small ones to fit
        assert d.segment.size == 8 * 2**20 and st.allocated_bytes == 8 * 2**20
        now[0] = 11.0
        assert st.reclaim_expired() == [d.lease_id]
        with pytest.raises(NotFound, match="expired"):
            st.begin_commit(d.lease_id)
        with pytest.raises(ResourceExhausted, match="does not fit the staging budget"):
            await st.acquire("j", 9 * 2**20)

    asyncio.run(scenario())
    assert len(list(tmp_path.iterdir())) == 1
    st.close()
    assert list(tmp_path.iterdir()) == []


def test_a_download_segment_is_allocated_as_it_fills_and_pooled_only_whole(
    tmp_path: Path,
) -> None:
    # A restore from the bucket fills a fresh segment part by part: its pages are
    # allocated chunk by chunk (no wait for the whole segment), and it goes back to
    # the pool for saves only once every page is allocated (a client writing into a
    # page never allocated dies of SIGBUS when /dev/shm is full).
    from ckptd.daemon.local.shm import can_populate

    if not can_populate():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    st = Staging("ckptd-test-", 64 * 2**20, 10.0, shm_dir=tmp_path)

    def allocated(seg: object) -> int:
        return os.stat(st.path_of(seg)).st_blocks * 512  # type: ignore[attr-defined]

    async def scenario() -> None:
        a = await st.acquire("j", 8 * 2**20, restore=True, populate=False)
        assert not a.segment.populated and allocated(a.segment) == 0
        a.segment.populate(2**20, 4096 + 1)  # rounded out to whole pages
        assert allocated(a.segment) == 2 * 4096
        a.segment.view(2**20, 8192)[:] = b"x" * 8192
        a.segment.populate()
        assert a.segment.populated and allocated(a.segment) == 8 * 2**20
        st.release(a.lease_id)
        b = await st.acquire("j", 8 * 2**20)
        assert b.segment is a.segment  # whole: pooled and reused for a save
        assert bytes(b.segment.view(2**20, 4)) == b"xxxx"
        st.release(b.lease_id)
        c = await st.acquire("j", 16 * 2**20, restore=True, populate=False)
        c.segment.populate(0, 4096)  # a download that failed part way
        st.release(c.lease_id)
        assert c.segment.name not in {p.name for p in tmp_path.iterdir()}  # dropped

    asyncio.run(scenario())
    st.close()


def test_example_config_in_deploy_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "deploy" / "ckptd.toml.example"
    cfg = config.load(example, env={})
    assert cfg.staging_budget_bytes == 16 * 2**30 and cfg.socket == Path("/run/ckptd/ckptd.sock")
    # Parsed once, into typed values.
    assert cfg.retention_local.describe() == "KeepLatest(2)"
    assert cfg.local_floor.bytes(2**40) == 20 * 2**30 and str(cfg.local_floor) == "20GiB"


def _spare_bytes(store: LocalStore) -> int:
    """Disk held by the store's spare files (evicted rank files kept for reuse)."""
    return sum(p.stat().st_size for p in store.spare_root.iterdir())


def test_evicted_rank_files_are_overwritten_in_place_by_later_saves(tmp_path: Path) -> None:
    import mmap

    from ckptd.daemon.files import write_file_direct
    from ckptd.daemon.local.store import LocalStore

    store = LocalStore(tmp_path / "root", spare_max_bytes=10 * 2**20)
    store.recover()
    step = store.step_dir("j", 1)
    step.mkdir(parents=True)
    (step / "rank-00000.safetensors").write_bytes(b"\x07" * (3 * 2**20 + 5))
    (step / "manifest.json").write_text("{}")
    store.evict("j", 1)
    assert not step.exists() and _spare_bytes(store) == 3 * 2**20 + 5
    assert store.take_spare(4 * 2**20) is None  # too small for this save
    buf = mmap.mmap(-1, 2 * 2**20)
    buf[:] = bytes(range(256)) * (2 * 2**20 // 256)
    header = header_of([TensorEntry("x", np.dtype("u1"), (2**20 + 3,), 0, 2**20 + 3)], {})
    out = tmp_path / "new.safetensors"
    write_file_direct(out, header, memoryview(buf), 2**20 + 3, store.take_spare(2**20))
    data = out.read_bytes()  # exactly the new file: no byte of the old one survives
    assert data == header + bytes(buf[: 2**20 + 3])
    assert _spare_bytes(store) == 0 and list(store.spare_root.iterdir()) == []
    step.mkdir(parents=True)
    (step / "rank-00000.safetensors").write_bytes(b"\x01" * (11 * 2**20))  # over the cap
    store.evict("j", 1)
    assert _spare_bytes(store) == 0 and list(store.trash_root.iterdir()) == []
    buf.close()


def test_an_evicted_rank_file_a_client_holds_mapped_is_never_kept_to_overwrite(
    tmp_path: Path,
) -> None:
    """Restored arrays view the file's pages: writing a later save into it would
    change them under the trainer. It is deleted instead (its mapping keeps it)."""
    from ckptd.client.rank_files import map_held
    from ckptd.daemon.local.store import LocalStore

    store = LocalStore(tmp_path / "root", spare_max_bytes=10 * 2**20)
    store.recover()
    step = store.step_dir("j", 1)
    step.mkdir(parents=True)
    rank = step / "rank-00000.safetensors"
    rank.write_bytes(b"\x07" * (2 * 2**20))
    (step / "manifest.json").write_text("{}")
    mm = map_held(os.open(rank, os.O_RDONLY), 2 * 2**20)
    store.evict("j", 1)
    assert not step.exists() and _spare_bytes(store) == 0
    assert mm[:4] == b"\x07" * 4 and len(mm) == 2 * 2**20  # still readable
    del mm  # the mapping gone, its lock goes: the next evicted file is kept
    step.mkdir(parents=True)
    rank.write_bytes(b"\x07" * (2 * 2**20))
    (step / "manifest.json").write_text("{}")
    store.evict("j", 1)
    assert _spare_bytes(store) == 2 * 2**20


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_rank_file_written_with_its_checksums_trailing_the_write(
    tmp_path: Path, where: str
) -> None:
    # O_DIRECT on a disk, buffered on tmpfs (which refuses O_DIRECT): either way the
    # checksums fed chunk by chunk behind the write equal one pass over the memory.
    import mmap

    from ckptd.core import checksum
    from ckptd.daemon import files

    base = tmp_path if where == "disk" else Path("/dev/shm")
    out = base / f"ckptd-test-{os.getpid()}.safetensors"
    size = 3 * files.WRITE_CHUNK // 2 + 12345  # two data chunks, the last one partial
    buf = mmap.mmap(-1, round_up(size))
    data = np.frombuffer(buf, np.uint8)
    data[:size] = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    ranges = [
        (0, 4096),
        (4096, files.WRITE_CHUNK),
        (files.WRITE_CHUNK + 4096, size - 4096 - files.WRITE_CHUNK),
    ]
    header = header_of([TensorEntry("x", np.dtype("u1"), (size,), 0, size)], {})
    try:
        got = files.write_file_checksummed(out, header, memoryview(buf), size, ranges)
        assert got[1] == [google_crc32c.value(data[o : o + n].tobytes()) for o, n in ranges]
        assert got[0] == checksum.of_file(out) and out.stat().st_size == len(header) + size
    finally:
        out.unlink(missing_ok=True)
        del data
        buf.close()


def test_liveness_probe_never_follows_a_symlink_nor_blocks_on_a_fifo(tmp_path: Path) -> None:
    from ckptd.daemon.local.liveness import locked_by_others

    fifo = tmp_path / "ckptd-client-1-aaaaaaaa"
    os.mkfifo(fifo)
    assert locked_by_others(fifo) is False  # opening it plainly would block the daemon
    target = tmp_path / "held"
    target.write_text("")
    fd = os.open(target, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    link = tmp_path / "ckptd-client-2-bbbbbbbb"
    link.symlink_to(target)
    assert locked_by_others(target) is True
    assert locked_by_others(link) is False  # a name that is not a plain file: no client
    os.close(fd)


def test_staging_grants_a_segment_again_only_to_the_uid_that_used_it(tmp_path: Path) -> None:
    owners = {"ja": 1000}
    st = Staging("ckptd-test-", 8 * 2**20, 10.0, shm_dir=tmp_path, uid_of=owners.get)

    async def scenario() -> None:
        a = await st.acquire("ja", 2**20, owner=(1000, 11))
        seg = a.segment
        assert seg.uid == 1000 and oct(os.stat(st.path_of(seg)).st_mode & 0o777) == "0o600"
        st.release(a.lease_id)
        b = await st.acquire("jb", 2**20, owner=(1001, 12))  # another user: a new segment
        assert b.segment is not seg and b.segment.uid == 1001
        st.release(b.lease_id)
        again = await st.acquire("ja", 2**20, owner=(1000, 13))  # the same user: reused
        assert again.segment is seg and again.owner == (1000, 13)
        st.release(again.lease_id)
        assert st.take_free("jb", 2**20) is None  # nobody owns jb: no used segment for it
        restore = st.take_free("ja", 2**20)  # the job's owner: its own segment
        assert restore is not None and restore.segment.uid == 1000
        assert not st.hold(restore, "", (1001, 14))  # handed to another uid: refused
        assert not st.holds(restore)
        # Under budget pressure, another uid's free segments are dropped, never lent.
        big = await st.acquire("jc", 7 * 2**20, owner=(1002, 15))
        assert big.segment.uid == 1002 and seg.name not in {s.name for s in st._segments.values()}
        st.close()

    asyncio.run(scenario())


def test_evicting_job_star_leaves_other_jobs_peers(tmp_path: Path) -> None:
    """A job may be named '*': evicting its step must not remove other jobs' peer parts."""
    from ckptd.daemon.local.store import LocalStore

    store = LocalStore(tmp_path)
    parts = [("*", 5, "n1"), ("other", 5, "n1"), ("x[", 5, "n1"), ("a", 1, "1.x"), ("a.1", 1, "x")]
    for job, step, node in parts:
        store.peer_dir(job, step, node).mkdir(parents=True)
    for job, step in (("*", 5), ("a", 1)):  # "a" 1 "1.x" once shared a flat name with "a.1"
        gone = tmp_path / "gone"
        gone.mkdir()
        store._delete(job, step, gone)
    left = [p for p in parts if store.peer_dir(*p).exists()]
    assert left == [("other", 5, "n1"), ("x[", 5, "n1"), ("a.1", 1, "x")]


def test_complex_arrays_are_aligned_to_their_size() -> None:
    # torch crashes copying a complex128 tensor that is only 8-aligned (numpy's
    # alignment): the layout puts complex arrays at multiples of their item size.
    from ckptd.core.format import plan_layout

    items = [
        ("f64", np.dtype("f8"), (3,)),
        ("c128", np.dtype("c16"), (5,)),
        ("f32", np.dtype("f4"), (1,)),
        ("c64", np.dtype("c8"), (3,)),
        ("c128b", np.dtype("c16"), (2,)),
    ]
    for e in plan_layout(items):
        want = e.dtype.itemsize if e.dtype.kind == "c" else e.dtype.alignment
        assert e.offset % want == 0, (e.key, e.offset)
