"""Every JAX pytree against a real daemon: optax states, flax TrainState and nnx.State,
equinox modules, registered dataclasses, typed PRNG keys (sharded too); restore
returns the target's own structure, and a mismatch names its path."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ckptd.client import TreeMismatch  # noqa: E402
from ckptd.core.shard_table import rows  # noqa: E402

from .conftest import Daemon  # noqa: E402

tu = jax.tree_util


def mesh(shape: tuple[int, int]) -> Mesh:
    n = shape[0] * shape[1]
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), ("x", "y"))


def params(seed: int = 0) -> dict[str, Any]:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "dense": {"w": jax.random.normal(k1, (4, 3)), "b": jnp.zeros(3)},
        "out": {"w": jax.random.normal(k2, (3, 2))},
    }


def same(a: Any, b: Any) -> None:
    """Same treedef, and every leaf bit-identical (typed keys by their key data)."""
    assert tu.tree_structure(a) == tu.tree_structure(b), (tu.tree_structure(a), b)
    for x, y in zip(tu.tree_leaves(a), tu.tree_leaves(b), strict=True):
        if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert y.dtype == x.dtype
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert np.asarray(x).dtype == np.asarray(y).dtype
        assert np.array_equal(np.asarray(x), np.asarray(y)), (x, y)


def saved_keys(daemon: Daemon, job: str, step: int) -> set[str]:
    """The leaf keys in the step's manifest (shard keys without their ``#n``)."""
    manifest = json.loads((daemon.root / job / str(step) / "manifest.json").read_text())
    return {r["key"].rsplit("#", 1)[0] for r in rows(manifest)}


def dicts_in(tree: Any) -> list[dict[str, Any]]:
    """Every dict in a tree of builtin containers."""
    if isinstance(tree, dict):
        return [tree, *(d for v in tree.values() for d in dicts_in(v))]
    if isinstance(tree, list | tuple):
        return [d for v in tree for d in dicts_in(v)]
    return []


def roundtrip(client: Any, step: int, state: Any) -> Any:
    client.save(step, state).wait("local", 60)
    restored, _ = client.restore(step=step, target=state)
    return restored


def loss(p: Any, x: Any) -> Any:
    h = jnp.tanh(x @ p["dense"]["w"] + p["dense"]["b"])
    return jnp.sum((h @ p["out"]["w"]) ** 2)


def train(tx: Any, p: Any, opt: Any, steps: int) -> tuple[Any, Any]:
    x = jnp.ones((5, 4))
    for _ in range(steps):
        g = jax.grad(loss)(p, x)
        updates, opt = tx.update(g, opt, p)
        p = optax.apply_updates(p, updates)
    return p, opt


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: optax.adam(1e-2),
        lambda: optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10, 1e-4), weight_decay=1e-3
        ),
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    ],
    ids=["adam", "adamw-schedule", "chain-clip-adamw"],
)
def test_optax_state_restores_as_its_own_types_and_trains_on(daemon: Daemon, make_tx: Any) -> None:
    tx = make_tx()
    p0 = params()
    p, opt = train(tx, p0, tx.init(p0), 3)
    client = daemon.client("optax")
    state = {"params": p, "opt_state": opt, "step": 3}
    back = roundtrip(client, 3, state)
    same(state, back)
    assert type(back["opt_state"]) is type(opt)  # NamedTuples, not plain tuples
    # Training on from the restored state is bit-identical to never stopping.
    want = train(tx, p, opt, 2)
    got = train(tx, back["params"], back["opt_state"], 2)
    same(want, got)
    # Shard keys name fields: opt_state.<i>.mu.<param path>.
    keys = saved_keys(daemon, "optax", 3)
    assert any(k.startswith("opt_state.") and k.endswith(".mu.dense.w") for k in keys), keys
    # Without a target: builtin containers, NamedTuple fields as dict keys by name.
    plain, _ = client.restore(step=3)
    adam = [d for d in dicts_in(plain["opt_state"]) if set(d) == {"count", "mu", "nu"}]
    assert len(adam) == 1 and np.array_equal(adam[0]["mu"]["dense"]["w"], mu_of(opt))
    assert len(tu.tree_leaves(plain)) == len(tu.tree_leaves(state))


def mu_of(opt: Any) -> Any:
    """The first moment of dense.w in any optax state holding one ScaleByAdamState."""
    found = [x for x in tu.tree_leaves(opt, is_leaf=lambda n: hasattr(n, "mu")) if hasattr(x, "mu")]
    return np.asarray(found[0].mu["dense"]["w"])


def test_flax_linen_train_state_applies_gradients_after_restore(daemon: Daemon) -> None:
    flax_nn = pytest.importorskip("flax.linen")
    from flax.training import train_state

    class MLP(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x: Any) -> Any:
            return flax_nn.Dense(2)(flax_nn.relu(flax_nn.Dense(8)(x)))

    model = MLP()
    x = jnp.ones((3, 4))
    variables = model.init(jax.random.key(0), x)
    tx = optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10))
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)

    def step(s: Any) -> Any:
        g = jax.grad(lambda p: jnp.sum(s.apply_fn({"params": p}, x) ** 2))(s.params)
        return s.apply_gradients(grads=g)

    state = step(step(state))
    client = daemon.client("linen")
    back = roundtrip(client, int(state.step), state)
    assert type(back) is train_state.TrainState and back.tx is tx and back.apply_fn == model.apply
    same(state, back)
    same(step(state), step(back))


def test_flax_nnx_state_merges_back_into_a_working_model(daemon: Daemon) -> None:
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.l2 = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return self.l2(self.bn(self.drop(nnx.relu(self.l1(x)))))

    model = Model(nnx.Rngs(0, dropout=1))
    x = jnp.ones((3, 4))
    model(x)  # moves the dropout key and the batch statistics
    graphdef, state = nnx.split(model)
    client = daemon.client("nnx")
    back = roundtrip(client, 1, state)
    assert type(back) is type(state)
    same(state, back)
    twin = nnx.merge(graphdef, back)
    assert np.array_equal(np.asarray(twin(x)), np.asarray(model(x)))  # same dropout key too


def test_equinox_module_saves_its_arrays_and_takes_functions_from_the_target(
    daemon: Daemon,
) -> None:
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(3))
    x = jnp.ones(4)
    client = daemon.client("eqx")
    # The module as it is: its arrays are saved, its activation functions (leaves
    # too, for jax) are not, as equinox's own tree_serialise_leaves does.
    client.save(1, model).wait("local", 60)
    assert saved_keys(daemon, "eqx", 1) == {
        f"layers.{i}.{p}" for i in range(3) for p in ("weight", "bias")
    }
    fresh = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(99))  # other values, same shape
    back, _ = client.restore(target=fresh)
    assert type(back) is type(model) and back.activation is fresh.activation
    assert np.array_equal(np.asarray(back(x)), np.asarray(model(x)))
    plain, _ = client.restore()  # no target: the functions were not saved
    assert plain["activation"] is None and np.array_equal(
        plain["layers"][0]["weight"], np.asarray(model.layers[0].weight)
    )
    # The filter/combine way works too.
    arrays, static = eqx.partition(model, eqx.is_array)
    client.save(2, eqx.filter(model, eqx.is_array)).wait("local", 60)
    back, _ = client.restore(step=2, target=arrays)
    same(arrays, back)
    again = eqx.combine(back, static)
    assert np.array_equal(np.asarray(again(x)), np.asarray(model(x)))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_typed_prng_keys_come_back_typed_in_their_implementation(daemon: Daemon, impl: str) -> None:
    key = jax.random.key(7, impl=impl)
    state = {"key": key, "many": jax.random.split(key, 3), "raw": jax.random.PRNGKey(1)}
    client = daemon.client("keys")
    client.save(1, state).wait("local", 60)
    back, _ = client.restore(target=state)
    same(state, back)
    assert str(jax.random.key_impl(back["key"])) == impl
    assert np.array_equal(jax.random.normal(back["key"], (3,)), jax.random.normal(key, (3,)))
    plain, _ = client.restore()  # no target: typed keys still, on the default device
    same(state, plain)
    other = "rbg" if impl == "threefry2x32" else "threefry2x32"
    with pytest.raises(TreeMismatch, match=r"\['key'\].*keys"):
        client.restore(target={**state, "key": jax.random.key(0, impl=other)})


def test_sharded_typed_keys_restore_onto_another_mesh(daemon: Daemon) -> None:
    keys = jax.random.split(jax.random.key(11), 8).reshape(4, 2)
    saved = jax.device_put(keys, NamedSharding(mesh((2, 2)), P("x", "y")))
    client = daemon.client("skeys")
    w = jax.device_put(jnp.arange(8.0), NamedSharding(mesh((2, 2)), P("x")))
    client.save(1, {"rng": saved, "w": w}).wait("local", 60)
    # Key data is (4, 2, 2) sharded over x and y: four distinct shards.
    assert client.list()[0].num_shards == 4 + 2
    on = NamedSharding(mesh((4, 1)), P("x", None))
    target = {
        "rng": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=on),
        "w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh((4, 1)), P())),
    }
    back, _ = client.restore(target=target)
    assert back["rng"].sharding.is_equivalent_to(on, 2) and back["rng"].dtype == keys.dtype
    assert np.array_equal(jax.random.key_data(back["rng"]), jax.random.key_data(keys))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    back, _ = client.restore(target={**target, "rng": jax.device_put(keys, one)})
    assert back["rng"].sharding == one
    assert np.array_equal(jax.random.key_data(back["rng"]), jax.random.key_data(keys))


@functools.partial(tu.register_dataclass, data_fields=["w", "nested"], meta_fields=["name"])
@dataclasses.dataclass
class Registered:
    w: Any
    nested: Any
    name: str


class Pair:
    """A custom node registered without keys: children are numbered."""

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b


tu.register_pytree_node(Pair, lambda p: ((p.a, p.b), None), lambda _, c: Pair(*c))


def test_registered_dataclass_and_custom_node(daemon: Daemon) -> None:
    state = {"s": Registered(jnp.ones(3), Pair(jnp.zeros(2), None), name="keep"), "n": None}
    client = daemon.client("reg")
    client.save(1, state).wait("local", 60)
    target = {"s": Registered(jnp.zeros(3), Pair(jnp.ones(2), None), name="keep"), "n": None}
    back, _ = client.restore(target=target)
    assert isinstance(back["s"], Registered) and back["s"].name == "keep"
    assert isinstance(back["s"].nested, Pair) and back["s"].nested.b is None
    same(state, back)
    assert saved_keys(daemon, "reg", 1) == {"s.w", "s.nested.0"}
    plain, _ = client.restore()
    assert set(plain["s"]) == {"w", "nested"} and plain["s"]["nested"][1] is None


def test_mismatches_name_the_path(daemon: Daemon) -> None:
    tx = optax.adam(1e-3)
    p = params()
    state = {"params": p, "opt_state": tx.init(p)}
    client = daemon.client("mismatch")
    client.save(1, state).wait("local", 60)
    missing = {"params": {"dense": p["dense"]}, "opt_state": state["opt_state"]}
    with pytest.raises(TreeMismatch, match=r"no entry 'out' at \['params'\] where the checkpoint"):
        client.restore(target=missing)
    extra = {**state, "params": {**p, "head": {"w": jnp.ones(2)}}}
    with pytest.raises(TreeMismatch, match=r"checkpoint has no entry 'head' at \['params'\]"):
        client.restore(target=extra)
    wide = tu.tree_map(lambda a: a, state)
    wide["opt_state"][0].mu["dense"]["w"] = jnp.zeros((4, 4))
    with pytest.raises(
        TreeMismatch, match=r"\['opt_state'\]\[0\]\['mu'\]\['dense'\]\['w'\].*shape"
    ):
        client.restore(target=wide)
    with pytest.raises(TreeMismatch, match=r"at \['params'\]\['out'\] the checkpoint has a dict"):
        client.restore(target={**state, "params": {**p, "out": jnp.ones(2)}})
