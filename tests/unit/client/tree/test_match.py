"""A save of the last save's structure is planned from the last spec, without
flattening the tree again (client/tree/match.py). Whatever the next tree is, the plan
must be the one a fresh flatten gives: the same spec text, keys, layout and arrays,
and a tree that differs anywhere is flattened anew."""

from __future__ import annotations

import gc
import json
import random
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ckptd.client.changes import tensor_token
from ckptd.client.planning import Planner
from ckptd.client.tree.match import match
from ckptd.client.tree.spec import flatten


def base_tree() -> dict[Any, Any]:
    return {
        "model": {
            "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "b": torch.ones(4, dtype=torch.bfloat16),
            "emb": np.arange(6, dtype=np.int32),
        },
        "opt": [{"m": jnp.zeros(5), "v": jnp.ones(5)}, (1, 2.5, "adam", None, True)],
        7: np.float32(0.5),
        "step": 3,
    }


def plan_fields(planner: Planner, tree: Any) -> tuple[Any, ...]:
    plan, arrays = planner.plan(tree, track=True, torch_versions=True)
    host = {k: (np.asarray(v).tobytes(), v.shape, str(v.dtype)) for k, v in arrays.host.items()}
    device = {k: (id(sp.data), sp.shape, sp.index) for k, sp in arrays.device.items()}
    tokens = sorted(k for k, t in (arrays.tokens or {}).items() if t is not None)
    return plan.tree_json, plan.layout, plan.placed, host, device, tokens


def mutations() -> list[tuple[str, Any]]:
    """Ways a tree can differ from base_tree(): each must be planned as if fresh."""

    def edit(fn: Any) -> Any:
        def make() -> dict[Any, Any]:
            t = base_tree()
            fn(t)
            return t

        return make

    def swap(t: dict[Any, Any]) -> None:
        m = t["model"]
        t["model"] = {"b": m["b"], "w": m["w"], "emb": m["emb"]}

    def retype(t: dict[Any, Any]) -> None:
        t["model"]["w"] = t["model"]["w"].numpy()

    return [
        ("same", edit(lambda t: None)),
        ("value changed", edit(lambda t: t.__setitem__("step", 4))),
        ("int became float", edit(lambda t: t.__setitem__("step", 3.0))),
        (
            "int became bool",
            edit(lambda t: t["opt"].__setitem__(1, (True, 2.5, "adam", None, True))),
        ),
        ("float sign", edit(lambda t: t["opt"].__setitem__(1, (1, -0.0, "adam", None, True)))),
        ("bigint", edit(lambda t: t.__setitem__("step", 2**70))),
        ("key renamed", edit(lambda t: t.__setitem__("model", {"W": t["model"]["w"]}))),
        ("keys reordered", edit(swap)),
        ("key added", edit(lambda t: t["model"].__setitem__("x", np.ones(2)))),
        ("int key became str", edit(lambda t: t.__setitem__("7", t.pop(7)))),
        (
            "tuple became list",
            edit(lambda t: t["opt"].__setitem__(1, [1, 2.5, "adam", None, True])),
        ),
        ("torch became numpy", edit(retype)),
        ("torch dtype", edit(lambda t: t["model"].__setitem__("b", torch.ones(4)))),
        ("torch shape", edit(lambda t: t["model"].__setitem__("w", torch.zeros(4, 3)))),
        ("jax dtype", edit(lambda t: t["opt"][0].__setitem__("m", jnp.zeros(5, jnp.int32)))),
        ("jax became numpy", edit(lambda t: t["opt"][0].__setitem__("m", np.zeros(5)))),
        ("numpy scalar became int", edit(lambda t: t.__setitem__(7, 1))),
        ("prng key", edit(lambda t: t.__setitem__("step", jax.random.key(0)))),
        ("leaf became dict", edit(lambda t: t.__setitem__("step", {"n": 3}))),
        ("object array", edit(lambda t: t["model"].__setitem__("emb", np.array([1, "a"], object)))),
    ]


@pytest.mark.parametrize(("name", "make"), mutations(), ids=[m[0] for m in mutations()])
def test_a_tree_after_the_base_plans_as_it_would_fresh(name: str, make: Any) -> None:
    """Plan base_tree() and then the mutated tree, against planning it first."""
    tree = make()
    fresh = Planner()
    try:
        want = plan_fields(fresh, tree)
    except (TypeError, ValueError) as exc:  # refused fresh: refused after the base too
        after = Planner()
        plan_fields(after, base_tree())
        with pytest.raises(type(exc)):
            plan_fields(after, tree)
        return
    after = Planner()
    plan_fields(after, base_tree())
    spec = after.last.spec if after.last is not None else None
    assert plan_fields(after, tree) == want
    if name == "same":  # planned from the last spec, not flattened again
        assert after.last is not None and after.last.spec is spec


def test_match_gives_flattens_pairs_or_none_for_any_other_structure() -> None:
    tree = base_tree()
    spec, arrays = flatten(tree, [], {}, tensor_token, True)
    values: list[Any] = []
    tokens: dict[str, Any] = {}
    found = match(tree, spec, values, tokens, tensor_token, True)
    assert found is not None
    assert [k for k, _ in found] == [k for k, _ in arrays]
    assert values == [1, 2.5, "adam", None, True, 3]
    assert sorted(tokens) == ["model.b", "model.w"]
    for (_, a), (_, b) in zip(found, arrays, strict=True):
        if isinstance(a, np.ndarray) and a.ndim:  # a view of the same memory
            assert a.__array_interface__ == b.__array_interface__
        elif isinstance(a, np.ndarray):  # a numpy scalar's 0-d array: its own copy
            assert a.tobytes() == b.tobytes() and a.dtype == b.dtype
        else:
            assert a is b
    for name, make in mutations()[1:]:
        other = make()
        try:
            other_spec, other_arrays = flatten(other, [], {}, tensor_token, True)
        except (TypeError, ValueError):
            assert match(other, spec, [], {}, tensor_token, True) is None, name
            continue
        got_values: list[Any] = []
        got = match(other, spec, got_values, {}, tensor_token, True)
        if json.dumps(other_spec) == json.dumps(spec):  # the same spec (another shape or dtype)
            assert got is not None and [k for k, _ in got] == [k for k, _ in other_arrays], name
        elif got is not None:  # the same structure: only the JSON leaves differ
            assert json.dumps(got_values) != json.dumps(values), name


def test_random_edits_plan_as_fresh_over_a_run_of_saves() -> None:
    """A run of saves, each a random edit of the one before (or none): a planner that
    planned them all gives each the plan a fresh planner does."""
    rng = random.Random(35)
    cases = mutations()
    planner = Planner()
    for _ in range(60):
        name, make = cases[0] if rng.random() < 0.5 else rng.choice(cases)
        tree = make()
        try:
            want = plan_fields(Planner(), tree)
        except (TypeError, ValueError):
            continue
        assert plan_fields(planner, tree) == want, name


def test_a_tensor_written_in_place_keeps_its_view_and_changes_its_token() -> None:
    w = torch.zeros(4)
    tree = {"w": w, "n": 1}
    planner = Planner()
    _, first = planner.plan(tree, track=True, torch_versions=True)
    w.add_(1)
    plan, again = planner.plan(tree, track=True, torch_versions=True)
    assert again.host["w"].tolist() == [1.0] * 4
    assert first.tokens is not None and again.tokens is not None
    assert first.tokens["w"] != again.tokens["w"]  # _version moved
    assert plan.tree_json == Planner().plan(tree)[0].tree_json


def test_kept_torch_views_follow_the_tensor_and_keep_nothing_alive() -> None:
    """A view is kept from save to save only while the tensor's memory is where it was:
    written in place it shows the new bytes, moved (set_, resize_, a new tensor) it is
    taken again, and a tensor the tree dropped is freed."""
    w = torch.zeros(6)
    tree: dict[str, Any] = {"w": w, "s": torch.ones(3)}
    planner = Planner()

    def saved() -> list[float]:
        _, arrays = planner.plan(tree, track=True, torch_versions=True)
        return list(arrays.host["w"].reshape(-1).tolist())

    assert saved() == [0.0] * 6  # flattened
    w.add_(1)
    assert saved() == [1.0] * 6  # matched: the view is taken and kept
    w.add_(1)
    assert saved() == [2.0] * 6  # the kept view, over the same memory
    assert planner._views["w"][2].base is not None and not isinstance(
        planner._views["w"][2].base, torch.Tensor
    )
    kept = planner._views["w"][2]
    w.mul_(2)
    assert planner.plan(tree, True, True)[1].host["w"] is kept and kept.tolist() == [4.0] * 6
    w.set_(torch.full((6,), 7.0).untyped_storage())
    assert saved() == [7.0] * 6  # another storage
    w.resize_(2, 3)
    assert saved() == [7.0] * 6 and planner.plan(tree, True, True)[1].host["w"].shape == (2, 3)
    tree["w"] = torch.arange(6.0)
    assert saved() == [float(i) for i in range(6)]  # another tensor
    dropped = tree.pop("s")
    ref = weakref.ref(dropped)
    del dropped
    tree["s"] = torch.zeros(3)
    saved()
    gc.collect()
    assert ref() is None  # the kept view of the old tensor did not hold it


def test_torch_tokens_tell_writes_and_moves_and_none_for_untracked_tensors() -> None:
    from ckptd.client.changes import same

    t = torch.zeros(4)
    a = tensor_token(t)
    assert same(a, tensor_token(t)) and same(a, tensor_token(t.detach()))
    t.add_(1)
    assert not same(a, tensor_token(t))  # written in place: _version moved
    b = tensor_token(t)
    assert not same(b, tensor_token(t[1:])) and not same(b, tensor_token(t.view(2, 2)))
    assert not same(b, tensor_token(torch.zeros(4)))  # another storage
    with torch.inference_mode():
        frozen = torch.zeros(4)
    assert tensor_token(frozen) is None  # no version counter: never unchanged


class Named(int):
    """An int key whose str() (which names its shard) is not its value's."""

    name: str

    def __new__(cls, value: int, name: str) -> Named:
        self = super().__new__(cls, value)
        self.name = name
        return self

    def __str__(self) -> str:
        return self.name


def test_key_subclasses_are_flattened_again() -> None:
    planner = Planner()
    planner.plan({Named(0, "enc"): np.ones(2)})
    got = planner.plan({Named(0, "dec"): np.ones(2)})[0]
    assert got.keys == Planner().plan({Named(0, "dec"): np.ones(2)})[0].keys == ["dec"]


@pytest.mark.parametrize("lazy", ["neg", "conj"])
def test_a_lazily_negated_or_conjugated_tensor_is_read_anew_each_save(lazy: str) -> None:
    """Its numpy view is of a resolved copy, freed after the save: never kept."""
    if lazy == "neg":
        base = torch.arange(8, dtype=torch.float32)
        t = torch._neg_view(base)
    else:
        base = torch.arange(8, dtype=torch.float32).to(torch.complex64) * (1 + 1j)
        t = base.conj()
    tree = {"w": t}
    planner = Planner()
    for _ in range(4):
        got = np.array(planner.plan(tree, track=True, torch_versions=True)[1].host["w"])
        want = np.array(Planner().plan(tree, track=True, torch_versions=True)[1].host["w"])
        assert got.tobytes() == want.tobytes()
        assert "w" not in planner._views
        gc.collect()
        base.add_(100)
        junk = [torch.full((8,), 7.0) for _ in range(50)]  # reuse freed memory
        del junk
