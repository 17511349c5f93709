"""The shard table (issue 13): a commit's shards as columns, checked with array
operations. Every malformed column is refused naming what is wrong, as the
per-shard messages were; the table and the older one-message-per-shard form give
the same checked table; a manifest's columns round-trip through JSON."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from ckptd.core.errors import InvalidArgument
from ckptd.core.format import TensorEntry, plan_layout
from ckptd.core.manifest import Manifest, RankRecord
from ckptd.core.shard_table import ShardTable, rows
from ckptd.core.shard_wire import decode, encode
from ckptd.daemon.api.requests import parse_commit
from ckptd.proto import ckptd_pb2 as pb

from .conftest import Daemon
from .test_refusals import call


def _layout(n: int = 3) -> tuple[list[TensorEntry], dict[str, str]]:
    entries = plan_layout([(f"w{i}", np.dtype("<f4"), (i + 1, 2)) for i in range(n)])
    return entries, {e.key: "<f4" for e in entries}


def _u8(values: list[int], dtype: str = "<u8") -> bytes:
    return np.array(values, dtype).tobytes()


def test_table_and_descriptors_give_the_same_checked_table() -> None:
    entries, dtypes = _layout()
    placed = {"w1": ((8, 2), [(2, 4), (0, 2)])}
    table = decode(encode(entries, dtypes, placed))
    req = pb.CommitShardsRequest(job="j", step=1)
    for e in entries:
        whole, where = placed.get(e.key, (e.shape, [(0, d) for d in e.shape]))
        req.shards.add(
            key=e.key,
            dtype="<f4",
            shape=e.shape,
            global_shape=whole,
            index=[pb.SliceSpec(start=a, stop=b) for a, b in where],
            offset=e.offset,
            length=e.length,
        )
    old = parse_commit(req).table
    assert old.columns_json() == table.columns_json()
    assert table.dims(table.global_shape)[table.keys.index("w1")] == [8, 2]
    assert table.dims(table.start)[table.keys.index("w1")] == [2, 0]
    assert table.check_layout() == sum(e.length for e in entries)


def _bad(edit: dict[str, Any]) -> pb.ShardTable:
    entries, dtypes = _layout()
    table = encode(entries, dtypes, {})
    for name, value in edit.items():
        if isinstance(value, list):
            del getattr(table, name)[:]
            getattr(table, name).extend(value)
        else:
            setattr(table, name, value)
    return table


BAD_TABLES = [
    ({"keys": ["a", "b"]}, "ndim holds 3 bytes; 2 values"),
    ({"keys": ["a", "a", "b"]}, "duplicate shard key 'a'"),
    ({"keys": ["a", "x/y", "b"]}, "path separator"),
    ({"keys": ["a", "", "b"]}, "empty"),
    ({"keys": ["a", "b\nc", "d"]}, "control character"),
    ({"keys": ["a", "__metadata__", "b"]}, "reserved"),
    ({"keys": ["a", "b" * 1025, "c"]}, "longer than 1024 bytes"),
    ({"dtype_index": _u8([0, 0, 1], "<u2")}, "past the 1 dtype names"),
    ({"dtype_names": ["float99"]}, "unknown dtype"),
    ({"ndim": _u8([2, 2], "u1")}, "2 bytes; 3 values"),
    ({"ndim": _u8([65, 2, 2], "u1")}, "more than 64 dimensions"),
    ({"shape": _u8([2**63, 2, 2, 2, 3, 2])}, "2\\*\\*62 or more"),
    ({"offset": _u8([0, 0, 0])}, "packed back to back"),
    ({"length": _u8([8, 16, 9])}, "length 9 != 24 bytes"),
    ({"global_shape": _u8([1, 2, 2, 2, 3, 1])}, "does not place shape"),
    ({"start": _u8([0, 0, 1, 0, 0, 0])}, "does not place shape"),
    ({"start": _u8([0, 0])}, "16 bytes; 6 values"),
]


@pytest.mark.parametrize(("edit", "match"), BAD_TABLES)
def test_bad_table_is_refused(edit: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        decode(_bad(edit)).check_layout()


def test_manifest_columns_round_trip_and_rows_match() -> None:
    entries, dtypes = _layout(4)
    placed = decode(encode(entries, dtypes, {})).placed(0, 4096, [1, 2, 3, 4])
    size = 4096 + sum(e.length for e in entries)
    rank = RankRecord(0, "rank-00000.safetensors", size, 5, {})
    m = Manifest("j", 1, "n", 1, 1.0, [rank], placed)
    back = Manifest.from_json(m.to_json())
    assert back.shards.columns_json() == placed.columns_json()
    raw = json.loads(m.to_json())
    assert [r["offset"] for r in rows(raw)] == [e.offset + 4096 for e in entries]
    assert [(r.key, r.crc32c, r.file) for r in back.shard_records()] == [
        (e.key, c, "rank-00000.safetensors") for e, c in zip(entries, [1, 2, 3, 4], strict=True)
    ]
    assert back.shards.of_rank(0).keys == [e.key for e in entries]
    assert len(back.shards.of_rank(1)) == 0
    both = ShardTable.concat([placed, placed.placed(1, 0, [9, 9, 9, 9])])
    assert both.of_rank(1).crc32c.tolist() == [9, 9, 9, 9]
    assert both.of_rank(1).dims(both.of_rank(1).shape) == [list(e.shape) for e in entries]


def test_daemon_refuses_a_bad_table_and_keeps_serving(daemon: Daemon) -> None:
    """A malformed table gets INVALID_ARGUMENT over the wire; the lease stays usable."""
    from ckptd.core.wire import Connection

    with Connection(daemon.socket) as conn:
        lease = conn.acquire_lease(pb.AcquireLeaseRequest(job="t", size_bytes=4096))
    req = pb.CommitShardsRequest(lease_id=lease.lease_id, job="t", step=1, table=_bad({}))
    req.table.length = _u8([8, 16, 9])
    code, message = call(daemon, "CommitShards", req)
    assert code == "INVALID_ARGUMENT" and "length 9 != 24 bytes" in message
    both = pb.CommitShardsRequest(lease_id=lease.lease_id, job="t", step=1, table=_bad({}))
    both.shards.add(key="a", dtype="<f4", shape=[1], offset=0, length=4)
    code, message = call(daemon, "CommitShards", both)
    assert code == "INVALID_ARGUMENT" and "not both" in message
    client = daemon.client("t")
    client.save(1, {"x": np.arange(4.0)}).wait("local", timeout=60)
    assert client.restore()[0]["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


def _depth_reference(text: str) -> int:
    """JSON nesting depth by a character-at-a-time scan (the obvious, slow way)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def test_tree_depth_check_matches_a_plain_scan() -> None:
    # The daemon's vectorised depth count (run on every commit's tree spec) agrees
    # with a plain scan on text full of escapes, quoted brackets and deep nesting.
    from ckptd.daemon.api.requests import MAX_JSON_DEPTH, _depth

    rng = np.random.default_rng(13)
    pieces = ["[", "{", "]", "}", '"a"', '"\\\\"', '"\\""', '"[\\"{"', '"\\\\[x"', '"]}\\\\"']
    for _ in range(200):
        picks = rng.choice(len(pieces), int(rng.integers(300, 3000)), p=[0.2, 0.2] + [0.075] * 8)
        text = "".join(pieces[i] for i in picks)
        want = _depth_reference(text)
        got = _depth(text)
        assert got == want or (got == 0 and text.count("[") + text.count("{") <= MAX_JSON_DEPTH)
    spec = json.dumps({"dict": [[f"k{i}", {"list": [{"array": f"a{i}"}]}] for i in range(500)]})
    assert _depth(spec) == _depth_reference(spec) == 6
    deep = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    assert _depth(deep) == MAX_JSON_DEPTH + 1
