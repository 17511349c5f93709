"""A save's structure is planned and checked once while it repeats: on the client (the
layout, shard table and tree spec text) and in the daemon (the checked table, tree
spec and rank layout). Every reuse must give the bytes and values a fresh plan would.
"""

from __future__ import annotations

import gc
import itertools
import math
from typing import Any

import numpy as np
import pytest

from ckptd.client.planning import Planner
from ckptd.core.errors import InvalidArgument
from ckptd.daemon.api.requests import CommitParser
from ckptd.proto import ckptd_pb2 as pb

from .conftest import Daemon


def layer_state(seed: int, n: int = 40) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    params = {
        f"layer{i:02d}": {
            "w": rng.standard_normal((16, 8), np.float32),
            "b": rng.standard_normal(8, np.float32),
            "scale": rng.standard_normal(8).astype(np.float16),
            "steps": np.int64(i),
        }
        for i in range(n)
    }
    return {"params": params, "opt": {"mu": params, "count": np.int32(seed)}}


def assert_same(a: object, b: object) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, np.ndarray | np.generic):
        b = np.asarray(b)
        assert b.dtype == np.asarray(a).dtype and b.shape == np.shape(a)
        assert b.tobytes() == np.asarray(a).tobytes()
    else:
        assert type(a) is type(b) and repr(a) == repr(b), (a, b)


def reused_plans(trees: list[dict[str, object]]) -> list[bool]:
    """For each tree after the first: whether a planner planning them in turn (as a
    client's does on each save) reused the previous plan: the same shard table object,
    not an equal one encoded again."""
    planner = Planner()
    tables = [planner.plan(tree)[0].table for tree in trees]
    return [b is a for a, b in itertools.pairwise(tables)]


def test_repeated_structure_reuses_the_plan_and_restores_every_step(daemon: Daemon) -> None:
    client = daemon.client("plan")
    states = [layer_state(s) for s in range(4)]
    for step, state in enumerate(states):
        client.save(step, state).wait("local")
        tree, _ = client.restore(step=step)
        assert_same(state, tree)
    assert reused_plans(states) == [True, True, True]


@pytest.mark.parametrize(
    "values", [[1, 1.0, True, 1], [0.0, -0.0, 0, False], [2, 2.5, "2", None], [math.inf, 1e308]]
)
def test_json_leaves_keep_their_exact_type_and_value_across_saves(
    daemon: Daemon, values: list[object]
) -> None:
    # 1 == 1.0 == True and 0.0 == -0.0 in Python: a plan reused on == alone would
    # store the previous save's spelling.
    client = daemon.client("values")
    w = np.arange(6, dtype=np.float32)
    for step, v in enumerate(values):
        client.save(step, {"w": w, "lr": v, "nested": [v, {"x": v}]}).wait("local")
        tree, _ = client.restore(step=step)
        for got in (tree["lr"], tree["nested"][0], tree["nested"][1]["x"]):
            assert type(got) is type(v) and repr(got) == repr(v), (step, got, v)


def test_a_changed_shape_dtype_or_key_is_planned_again(daemon: Daemon) -> None:
    client = daemon.client("replan")
    trees = [
        {"a": np.ones((4, 4), np.float32), "b": np.zeros(3, np.int8)},
        {"a": np.ones((2, 8), np.float32), "b": np.zeros(3, np.int8)},  # shape
        {"a": np.ones((2, 8), np.float64), "b": np.zeros(3, np.int8)},  # dtype
        {"a": np.ones((2, 8), np.float64), "c": np.zeros(3, np.int8)},  # key
        {"a": np.ones((2, 8), np.float64), "c": np.zeros(3, np.int8)},  # same: reused
    ]
    for step, tree in enumerate(trees):
        tree["a"] = tree["a"] * (step + 1)  # type: ignore[operator]
        client.save(step, tree).wait("local")
        got, _ = client.restore(step=step)
        assert_same(tree, got)
    assert reused_plans(trees) == [False, False, False, True]


def test_runs_of_one_dtype_are_copied_exactly_around_others(daemon: Daemon) -> None:
    # The copy joins arrays of one dtype that lie back to back into one concatenate:
    # views that are not C-contiguous, byte-swapped and 0-d arrays break the runs.
    rng = np.random.default_rng(3)
    base = rng.standard_normal((8, 6), np.float32)
    tree = {
        "a": rng.standard_normal(5, np.float32),
        "t": base.T,  # not C-contiguous
        "b": rng.standard_normal((3, 3), np.float32),
        "s": np.float32(7.5),
        "big": rng.standard_normal(3 * 2**20, np.float32),
        "be": np.arange(9, dtype=">f4"),
        "c": rng.standard_normal(7, np.float32),
        "h": rng.standard_normal(5).astype(np.float16),
        "z": np.zeros((0, 4), np.float32),
    }
    client = daemon.client("runs")
    for step in range(2):
        client.save(step, tree).wait("local")
        got, _ = client.restore(step=step)
        assert_same(tree, got)


def _request(tree_json: str, keys: list[str]) -> pb.CommitShardsRequest:
    n = len(keys)
    return pb.CommitShardsRequest(
        lease_id="l",
        job="j",
        step=1,
        rank=0,
        table=pb.ShardTable(
            keys=keys,
            dtype_names=["<f4"],
            dtype_index=np.zeros(n, "<u2").tobytes(),
            ndim=np.ones(n, np.uint8).tobytes(),
            shape=np.full(n, 2, "<u8").tobytes(),
            offset=(np.arange(n, dtype="<u8") * 8).tobytes(),
            length=np.full(n, 8, "<u8").tobytes(),
        ),
        tree_json=tree_json,
    )


def test_the_daemon_reuses_only_what_is_byte_for_byte_what_it_checked() -> None:
    parser = CommitParser()
    spec = '{"dict": [["a", {"array": "a"}], ["b", {"array": "b"}]]}'
    first = parser.parse(_request(spec, ["a", "b"]))
    again = parser.parse(_request(spec, ["a", "b"]))
    assert again.table is first.table  # one checked table, shared
    assert again.tree is first.tree
    # The same table with a spec that is not JSON: the spec is checked again.
    with pytest.raises(InvalidArgument, match="tree_json is not valid JSON"):
        parser.parse(_request(spec[:-1], ["a", "b"]))
    # A bad key in an otherwise equal-looking table: checked again and refused.
    with pytest.raises(InvalidArgument, match="shard key"):
        parser.parse(_request(spec, ["a", "../b"]))
    changed = parser.parse(_request(spec, ["a", "c"]))
    assert changed.table is not first.table and changed.table.keys == ["a", "c"]


def test_jax_shards_are_planned_once_while_the_array_lives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jnp = pytest.importorskip("jax.numpy")
    from ckptd.client import planning

    asked: list[str] = []
    real = planning.leaf_shards

    def leaf_shards(key: str, a: Any, replicas: Any) -> Any:
        asked.append(key)
        return real(key, a, replicas)

    monkeypatch.setattr(planning, "leaf_shards", leaf_shards)
    # As if the arrays were sharded over devices (a single-device array's one shard is
    # itself, told without asking jax or the cache).
    monkeypatch.setattr(planning, "single_shard", lambda key, a: None)
    planner = Planner()
    frozen, trained = jnp.arange(8.0), jnp.ones(4)
    planner.plan({"frozen": frozen, "trained": trained})
    trained = trained + 1  # a new array, as an optimizer's update makes
    got = planner.plan({"frozen": frozen, "trained": trained})[1].device
    assert asked == ["frozen", "trained", "trained"]  # the same array: asked once
    assert got["frozen#0"].data is frozen and got["frozen#0"].index == [(0, 8)]
    assert np.asarray(got["trained#0"].data).tolist() == [2.0] * 4
    # Under another key the same array is asked again (its shard keys name the leaf).
    moved = planner.plan({"renamed": frozen, "trained": trained})[1].device
    assert list(moved) == ["renamed#0", "trained#0"] and asked[-1] == "renamed"
    # The cache holds no array: those that died took their entries with them.
    del got, moved, trained
    gc.collect()
    assert [ref() for ref, _, _ in planner._shards.values()] == [frozen]


def test_a_single_device_array_is_its_own_one_shard() -> None:
    """What jax's addressable_shards says, taken without asking it (shapes of every rank)."""
    jnp = pytest.importorskip("jax.numpy")
    from ckptd.client.leaves.jax_arrays import leaf_shards

    for a in (jnp.float32(2.5), jnp.zeros((0,)), jnp.arange(12.0).reshape(3, 4)):
        (got,) = leaf_shards("k", a, False)
        (shard,) = a.addressable_shards
        want = [s.indices(d)[:2] for s, d in zip(shard.index, a.shape, strict=True)]
        assert (got.key, got.shape, got.index) == ("k#0", a.shape, want)
        assert got.data is a and shard.data is a
