"""The manifest validator and the bucket's key parsing (issue 12): every name that
comes from a manifest or a listing is checked before it can reach a local path or a
key. The end-to-end side (a real daemon and bucket) is in test_remote_names.py."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from ckptd.core.errors import InvalidArgument
from ckptd.core.manifest import Manifest, ManifestInvalid, RankRecord, ShardRecord
from ckptd.core.names import check_tree_path
from ckptd.daemon.remote import index
from ckptd.daemon.remote.layout import file_key, parse_marker, tree_path

from ...test_remote_names import NODE, set_field


# -- the validator ------------------------------------------------------------------
def _arrays() -> dict[str, Any]:
    shard = ShardRecord(
        "w", 0, "float32", [4], [8], [[0, 4]], "rank-00000.safetensors", 4096, 16, 7
    )
    rank = RankRecord(0, "rank-00000.safetensors", 4112, 9, {"w": None})
    m = Manifest("job", 3, NODE, 2, 1.0, [rank], [shard])
    return json.loads(m.to_json())


def _arrays_v1() -> dict[str, Any]:
    """The same manifest as format version 1 wrote it: one object per shard."""
    raw = _arrays()
    raw["format_version"] = 1
    raw["shards"] = [
        {
            "key": "w",
            "rank": 0,
            "dtype": "float32",
            "shape": [4],
            "global_shape": [8],
            "index": [[0, 4]],
            "file": "rank-00000.safetensors",
            "offset": 4096,
            "length": 16,
            "crc32c": 7,
        }
    ]
    return raw


def _directory() -> dict[str, Any]:
    files = ["files/.metadata", "files/a..b", "files/default/d/abc", "files/commit_success.txt"]
    ranks = [RankRecord(i, f, 10, 1, None) for i, f in enumerate(files)]
    m = Manifest("job", 3, NODE, 1, 1.0, ranks, [], kind="directory", source="/src")
    return json.loads(m.to_json())


def test_valid_manifests_pass_both_kinds() -> None:
    for raw in (_arrays(), _directory()):
        text = json.dumps(raw)
        assert Manifest.from_json(text).to_json() == Manifest.from_json(text).check().to_json()


def test_version_1_reads_as_the_same_columns() -> None:
    old = Manifest.from_json(json.dumps(_arrays_v1()))
    new = Manifest.from_json(json.dumps(_arrays()))
    assert old.shards.columns_json() == new.shards.columns_json()
    assert old.shard_records() == new.shard_records()
    assert old.shard_records()[0].index == [[0, 4]]
    assert old.to_json() == json.dumps(_arrays_v1())  # a copy keeps the text it came as


BAD_ARRAYS = [
    ("ranks.0.file", "/tmp/outside/evil", "ranks[0].file"),
    ("ranks.0.file", "../../evil", "ranks[0].file"),
    ("ranks.0.file", "sub/rank-00000.safetensors", "ranks[0].file"),
    ("ranks.0.file", "", "ranks[0].file"),
    ("ranks.0.file", ".hidden", "ranks[0].file"),
    ("ranks.0.file", "a\x00b", "ranks[0].file"),
    ("ranks.0.file", 5, "ranks[0].file"),
    ("ranks.0.rank", 2, "ranks[0].rank"),  # world_size is 2
    ("ranks.0.rank", -1, "ranks[0].rank"),
    ("ranks.0.size", -1, "ranks[0].size"),
    ("ranks.0.crc32c", 2**32, "ranks[0].crc32c"),
    ("job", "../job", "job"),
    ("job", ".staging", "job"),
    ("node", "a/b", "node"),
    ("step", -1, "step"),
    ("step", 2**62, "step"),
    ("world_size", 0, "world_size"),
    ("shards.0.file", "/etc/passwd", "shards[0]"),
    ("shards.0.rank", 1, "shards[0]"),
    ("shards.0.offset", -1, "offset has a value outside"),
    ("shards.0.length", 17, "ends past the file"),  # 4096 + 17 > 4112
    ("shards.0.key", "__metadata__", "shards[0].key"),
    ("shards.0.index", [[0, 4, 5]], "shards[0].index"),
    ("shards.0.shape", ["4"], "shards.shape must be a list of integers"),
    ("kind", "tarball", "kind"),
    ("data_layout", 4, "data_layout"),
    ("data_layout", "2", "data_layout"),
    ("format_version", 3, "format_version"),
]


@pytest.mark.parametrize(("path", "value", "field"), BAD_ARRAYS)
def test_bad_arrays_manifest_is_refused_naming_the_field(path: str, value: Any, field: str) -> None:
    raw = _arrays_v1()
    set_field(path, value)(raw)
    with pytest.raises(ManifestInvalid, match=field.replace("[", r"\[").replace("]", r"\]")):
        Manifest.from_json(json.dumps(raw))


BAD_COLUMNS = [
    ("shards.key.0", "__metadata__", "shard key"),
    ("shards.key.0", "../w", "shard key"),
    ("shards.key", "w", "shards.key must be a list"),
    ("shards.rank.0", 1, "names rank 1"),
    ("shards.offset.0", -1, "offset has a value outside"),
    ("shards.length.0", 17, "ends past the file of rank 0"),
    ("shards.ndim.0", 2, "holds 1 values, not 2"),
    ("shards.shape.0", "4", "shards.shape must be a list of integers"),
    ("shards.shape.0", True, "shards.shape must be a list of integers"),
    ("shards.start.0", 5, "does not place shape"),
    ("shards.crc32c.0", 2**32, "crc32c"),
    ("shards.length", [16, 16], "1 shard keys but 2 values of length"),
    ("shards.global_shape.0", 2**70, "outside 64 bits"),
]


@pytest.mark.parametrize(("path", "value", "field"), BAD_COLUMNS)
def test_bad_shard_columns_are_refused_naming_the_column(path: str, value: Any, field: str) -> None:
    raw = _arrays()
    set_field(path, value)(raw)
    with pytest.raises(ManifestInvalid, match=field.replace("[", r"\[")):
        Manifest.from_json(json.dumps(raw))
    raw = _arrays()
    del raw["shards"]["crc32c"]
    with pytest.raises(ManifestInvalid, match="must hold the columns"):
        Manifest.from_json(json.dumps(raw))


def test_bad_arrays_manifest_duplicates_and_garbage() -> None:
    raw = _arrays()
    raw["ranks"].append(copy.deepcopy(raw["ranks"][0]))
    with pytest.raises(ManifestInvalid, match="appears twice"):
        Manifest.from_json(json.dumps(raw))
    for text in (
        "{ not json",
        "[]",
        '{"format_version": 1}',
        json.dumps({**_arrays(), "ranks": 3}),
    ):
        with pytest.raises(ManifestInvalid):
            Manifest.from_json(text)
    # Still a ValueError (readers that set aside unreadable manifests catch that) and a
    # DataLoss (the copy is corrupt).
    assert issubclass(ManifestInvalid, ValueError)


BAD_TREE_FILES = [
    "/tmp/outside/evil",
    "files/../../evil",
    "files/a/../../evil",
    "files/./x",
    "files//x",
    "files/x/",
    "files/",
    "default/x",  # not under files/
    "files/a\nb",
    "files/" + "/".join(["d"] * 70),
    "files/" + "x" * 256,
]


@pytest.mark.parametrize("name", BAD_TREE_FILES)
def test_bad_adopted_file_is_refused(name: str) -> None:
    raw = _directory()
    raw["ranks"][1]["file"] = name
    with pytest.raises(ManifestInvalid, match=r"ranks\[1\].file"):
        Manifest.from_json(json.dumps(raw))


def test_adopted_tree_file_may_not_also_be_a_directory() -> None:
    raw = _directory()
    raw["ranks"][0]["file"] = "files/default/d"  # and files/default/d/abc is a file
    with pytest.raises(ManifestInvalid, match="both a file and the directory"):
        Manifest.from_json(json.dumps(raw))
    raw = _directory()
    raw["shards"] = _arrays()["shards"]
    with pytest.raises(ManifestInvalid, match="no shards"):
        Manifest.from_json(json.dumps(raw))


def test_check_tree_path_accepts_what_frameworks_write() -> None:
    for ok in ("files/.zarray", "files/a..b/c", "files/ocdbt.process_0/d/7f3a", "files/x y"):
        assert check_tree_path("f", ok) == ok
    for bad in ("", "/a", "a/../b", "..", "a/./b", "a//b"):
        with pytest.raises(InvalidArgument):
            check_tree_path("f", bad)


# -- keys from listings ----------------------------------------------------------------
def test_listed_keys_with_bad_names_are_skipped() -> None:
    assert parse_marker("job/3/_complete/node-1") == ("job", 3, "node-1", False)
    assert parse_marker("job/3.ckptd/_complete/node-1") == ("job", 3, "node-1", True)
    for bad in (
        "job/3/_complete/a..b",
        "job/3/_complete/.node",
        "job/3/_complete/a\nb",
        ".evil/3/_complete/node",
        "a..b/3/_complete/node",
        "job/²/_complete/node",  # str.isdigit() is true, int() raises
        "job/٣/_complete/node",  # another script's digit: would name step 3
        "job/007/_complete/node",  # not how ckptd writes step 7
        f"job/{2**62}/_complete/node",
        "job/-3/_complete/node",
    ):
        assert parse_marker(bad) is None, bad


def test_file_keys_refuse_names_that_leave_the_step() -> None:
    assert file_key("j", 3, "n", "rank-00000.safetensors") == "j/3/n/rank-00000.safetensors"
    assert file_key("j", 3, "n", "files/default/x", adopted=True) == "j/3/default/x"
    for name in ("../x", "/abs", "a/b"):
        with pytest.raises(InvalidArgument):
            file_key("j", 3, "n", name)
    for name in ("files/../../x", "/abs", "files//x", "x"):
        with pytest.raises(InvalidArgument):
            tree_path(name)


def test_the_step_index_ignores_entries_and_fields_of_the_wrong_type() -> None:
    # Bucket content: a bad entry is skipped, a bad field ignored; the daemon starts.
    raw = json.dumps({"format": 1, "steps": [
        {"step": 4, "created_unix": "soon", "metrics": [1], "milestone": 1},
        {"step": 5, "created_unix": 7, "metrics": {"loss": 0.5, "x": "y", "b": True,
                                                   "n": float("nan")}, "milestone": True},
        {"step": -1}, {"step": "6"}, {"step": True}, {"step": 2**63}, "x", None,
    ]}).encode()  # fmt: skip
    assert index.decode(raw) == {
        4: index.Entry(4),
        5: index.Entry(5, created_unix=7.0, metrics={"loss": 0.5}, milestone=True),
    }
    back = index.decode(index.encode("j", "n", index.decode(raw)))
    assert back == index.decode(raw)
    for bad in (b"[]", b'{"format": 2, "steps": []}', b"{"):
        with pytest.raises(ValueError):
            index.decode(bad)
    assert index.index_key("job", "node-1") == "job/_index/node-1.json"
    with pytest.raises(InvalidArgument):
        index.index_key("job", "../x")


def test_a_commits_tree_text_goes_into_the_manifest_as_written() -> None:
    # The daemon keeps the client's tree spec text (checked JSON) instead of parsing
    # and re-serialising it; the manifest reads back with the same tree, and text in
    # other fields that looks like the placeholder stays as it was.
    from ckptd.core.manifest import Manifest, RankRecord, RawJson, rank_file_name
    from ckptd.core.shard_table import empty_table

    tree_text = '{"dict": [["w", {"array": "w"}], ["lr", {"value": 0.5}], ["n", {"value": NaN}]]}'
    ranks = [
        RankRecord(r, rank_file_name(r), 8, 0, RawJson(tree_text) if r else {"list": []})
        for r in range(2)
    ]
    m = Manifest(
        job="j",
        step=1,
        node="n",
        world_size=2,
        created_unix=1.0,
        ranks=ranks,
        shards=empty_table(),
        metadata={"note": "\u0000deadbeef:1", "tree": tree_text},
    )
    text = m.to_json()
    assert tree_text in text
    back = Manifest.from_json(text)
    assert back.ranks[0].tree == {"list": []}
    got = back.ranks[1].tree
    assert got["dict"][:2] == [["w", {"array": "w"}], ["lr", {"value": 0.5}]]
    assert got["dict"][2][1]["value"] != got["dict"][2][1]["value"]  # NaN kept
    assert back.metadata == {"note": "\u0000deadbeef:1", "tree": tree_text}
    assert isinstance(ranks[1].tree, RawJson)  # the records are not changed by writing
