"""Pytrees nested too deeply: a clear error naming the limit and what to do, on save
and on restore, never a bare RecursionError; the deepest allowed tree round-trips."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pytest

from ckptd.client.tree.nodes import MAX_TREE_DEPTH
from ckptd.client.tree.spec import flatten, unflatten
from ckptd.core.errors import InvalidArgument

from .conftest import Daemon

LIMIT_WORDS = f"deeper than {MAX_TREE_DEPTH} levels"


class Pair(NamedTuple):
    """A pytree node of jax's (and of ckptd's without jax)."""

    first: Any
    second: Any


def nested(depth: int, leaf: Any, kind: str = "dict") -> Any:
    """``depth`` containers one inside the other, ``leaf`` in the innermost."""
    tree = leaf
    for i in range(depth):
        tree = {"k": tree} if kind == "dict" else [tree] if kind == "list" else (tree, i)
    return tree


def nested_spec(depth: int) -> Any:
    """A saved spec ``depth`` dicts deep (as a manifest not written by ckptd might hold)."""
    spec: Any = {"array": "x"}
    for _ in range(depth):
        spec = {"dict": [["k", spec]]}
    return spec


@pytest.mark.parametrize("kind", ["dict", "list", "tuple"])
def test_a_2000_level_numpy_tree_is_refused_clearly(kind: str) -> None:
    with pytest.raises(InvalidArgument, match=LIMIT_WORDS) as info:
        flatten(nested(2000, np.zeros(2), kind))
    assert "flatten the deep part" in str(info.value)
    assert not isinstance(info.value.__context__, RecursionError)


def test_a_tree_that_contains_itself_is_refused_clearly() -> None:
    tree: dict[str, Any] = {"w": np.zeros(2)}
    tree["self"] = tree
    with pytest.raises(InvalidArgument, match=LIMIT_WORDS):
        flatten(tree)


def test_the_deepest_allowed_tree_flattens_and_comes_back() -> None:
    tree = nested(MAX_TREE_DEPTH, np.arange(3))
    spec, arrays = flatten(tree)
    back = unflatten(spec, dict(arrays))
    for _ in range(MAX_TREE_DEPTH):
        back = back["k"]
    assert np.array_equal(back, np.arange(3))
    with pytest.raises(InvalidArgument, match=LIMIT_WORDS):
        flatten(nested(MAX_TREE_DEPTH + 1, np.arange(3)))


def test_torch_and_jax_leaves_in_a_too_deep_tree() -> None:
    torch = pytest.importorskip("torch", reason="the torch case needs torch")
    with pytest.raises(InvalidArgument, match=LIMIT_WORDS):
        flatten(nested(2000, torch.zeros(2)))
    jax = pytest.importorskip("jax", reason="the jax case needs jax")
    with pytest.raises(InvalidArgument, match=LIMIT_WORDS):
        flatten(nested(2000, jax.numpy.zeros(2)))
    # Pytree nodes jax flattens (NamedTuples), nested too deeply as well.
    state: Any = jax.numpy.zeros(2)
    for _ in range(2000):
        state = Pair(state, None)
    with pytest.raises(InvalidArgument, match=LIMIT_WORDS):
        flatten(state)


@pytest.mark.parametrize("with_target", [False, True])
def test_restoring_a_too_deep_spec_is_refused_clearly(with_target: bool) -> None:
    target = nested(2000, np.zeros(1)) if with_target else None
    with pytest.raises(InvalidArgument, match=LIMIT_WORDS) as info:
        unflatten(nested_spec(2000), {"x": np.zeros(1)}, target=target)
    assert "was not written by" in str(info.value)


def test_save_of_a_too_deep_tree_through_the_client(daemon: Daemon) -> None:
    client = daemon.client("deep")
    with pytest.raises(InvalidArgument, match=LIMIT_WORDS):
        client.save(1, nested(2000, np.zeros(2)))
    # The limit is one the daemon accepts: the deepest allowed tree commits and restores.
    client.save(2, nested(MAX_TREE_DEPTH, np.arange(5.0))).wait("local")
    tree, _ = client.restore(step=2, target=nested(MAX_TREE_DEPTH, np.zeros(5)))
    for _ in range(MAX_TREE_DEPTH):
        tree = tree["k"]
    assert tree.tobytes() == np.arange(5.0).tobytes()
    assert [c.step for c in client.list()] == [2]
