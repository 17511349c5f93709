"""``jax.Array`` leaves: save each addressable shard once, restore onto any sharding.

Save: every addressable shard with ``replica_id == 0`` (all replicas with
``save_replicas``) becomes one shard in the rank's file, keyed
``<leaf key>#<n>``, with its index into the global array. jax never writes an
array once made, so the device-to-host copies of arrays on an accelerator run on
a client thread after ``save()`` has returned; a CPU array's memory may be
numpy's or torch's (client/changes.py), so it is copied before, unless trusted.

Restore with a target (``jax.ShapeDtypeStruct`` with a sharding, or an array
whose sharding to copy): each leaf is built with ``jax.make_array_from_callback``;
the callback assembles just the slice a device needs from the saved shards that
overlap it, read from the mapped shard files, each shard checked against its
crc32c the first time it is used. A different mesh, sharding or device count
from the one that saved works the same way.

jax is imported only when a tree holds jax arrays or a target is given.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ckptd.core.errors import TreeMismatch
from ckptd.core.format import str_to_dtype

from ..shards import ShardReader, global_shape_of


def is_jax_array(node: Any) -> bool:
    """True for a ``jax.Array`` (without importing jax if the program has not)."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(node, jax.Array)


def _bounds(s: slice, dim: int) -> tuple[int, int]:
    start, stop, step = s.indices(dim)
    if step != 1:
        raise ValueError(f"shard index {s} has a step; ckptd stores contiguous shards only")
    return start, stop


@dataclass(slots=True)
class ShardPlan:
    """One shard of a jax leaf to save (not frozen: a save of a thousand arrays makes
    one each, and a frozen dataclass took 3x as long to build)."""

    key: str
    data: Any
    """The shard's single-device jax array."""
    shape: tuple[int, ...]
    index: list[tuple[int, int]]


Replicas = bool | Literal["process"]
"""Which replicas of its shards a process saves: False, replica 0 only (one copy in the
job); ``"process"``, each distinct shard it holds once (every node can restore its
devices' shards from its own part, for a copy per process of what is replicated
across processes); True, every replica."""


_LOCAL: dict[int, tuple[Any, bool]] = {}
"""Per single-device sharding (jax shares one per device): whether this process holds
its device."""


def single_shard(key: str, array: Any) -> ShardPlan | None:
    """The one shard of a jax array on a single device of this process (the array
    itself), or None for any other array. Asking jax for the shards costs ~5 us an
    array, and an optimizer step makes every trained array a new one."""
    sharding = array.sharding
    hit = _LOCAL.get(id(sharding))
    if hit is None or hit[0] is not sharding:
        jax = sys.modules["jax"]
        local = type(sharding) is jax.sharding.SingleDeviceSharding and array.is_fully_addressable
        if len(_LOCAL) > 1024:
            _LOCAL.clear()
        hit = _LOCAL[id(sharding)] = (sharding, local)
    if not hit[1]:
        return None
    shape = array.shape  # (jax's: a tuple of ints)
    if type(shape) is not tuple:
        shape = tuple(int(d) for d in shape)
    return ShardPlan(f"{key}#0", array, shape, [(0, d) for d in shape])


def leaf_shards(key: str, array: Any, save_replicas: Replicas) -> list[ShardPlan]:
    """The shards of a jax array this process saves (its addressable ones, replica 0)."""
    one = single_shard(key, array)
    if one is not None:
        return [one]
    shape = tuple(int(d) for d in array.shape)
    plans: list[ShardPlan] = []
    seen: set[tuple[tuple[int, int], ...]] = set()
    for shard in array.addressable_shards:
        index = [_bounds(s, d) for s, d in zip(shard.index, shape, strict=True)]
        if save_replicas == "process":
            if tuple(index) in seen:
                continue
            seen.add(tuple(index))
        elif shard.replica_id != 0 and not save_replicas:
            continue
        plans.append(
            ShardPlan(
                f"{key}#{len(plans)}",
                shard.data,
                tuple(b - a for a, b in index),
                index,
            )
        )
    return plans


def build_leaf(reader: ShardReader, spec: dict[str, Any], target: Any) -> Any:
    """A saved jax leaf: onto ``target``'s sharding, or as a numpy array when the target
    leaf is no array (None, a Python scalar); typed PRNG keys: :func:`build_keys`."""
    if "key_impl" in spec:
        return build_keys(reader, spec, target)
    leaf = spec["jax"]
    dtype = str_to_dtype(spec["dtype"])
    shape = global_shape_of(reader, leaf)
    if not hasattr(target, "shape"):
        # No target, or a Python scalar where the saved tree has an array (flax's
        # TrainState.create starts with step=0 and trains on with a jax step): as saved.
        return reader.assemble(leaf, [(0, d) for d in shape], dtype)
    return _onto(reader, leaf, dtype, shape, target)


def _onto(
    reader: ShardReader, leaf: str, dtype: np.dtype, shape: tuple[int, ...], target: Any
) -> Any:
    """The leaf as a jax array on ``target``'s sharding, each device's block assembled
    from the saved shards that overlap it."""
    import jax

    if tuple(target.shape) != shape:
        raise TreeMismatch(f"target for {leaf!r} has shape {tuple(target.shape)}, saved {shape}")
    if np.dtype(target.dtype) != dtype:
        raise TreeMismatch(f"target for {leaf!r} has dtype {target.dtype}, saved {dtype}")
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        raise TreeMismatch(
            f"target for {leaf!r} has no sharding; use jax.ShapeDtypeStruct(..., sharding=...)"
        )

    def block(index: tuple[slice, ...] | None) -> np.ndarray:
        bounds = [_bounds(s, d) for s, d in zip(index or (), shape, strict=True)]
        return reader.assemble(leaf, bounds or [(0, d) for d in shape], dtype, view_ok=True)

    return jax.make_array_from_callback(shape, sharding, block)


def key_data_of(array: Any, where: str) -> tuple[Any, str]:
    """A typed PRNG key array as its key data (a uint32 ``jax.Array``, sharded like the
    keys with the key's own dimensions replicated) and its implementation's name."""
    import jax

    if not jax.numpy.issubdtype(array.dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"array at {where} has dtype {array.dtype}, which ckptd cannot store (typed "
            "PRNG keys and fixed-size dtypes only)"
        )
    return jax.random.key_data(array), str(jax.random.key_impl(array))


_KEY_DTYPES: dict[str, Any] = {}


def _key_dtype(jax: Any, impl: str) -> Any:
    """The key dtype of implementation ``impl`` (abstractly: no key is computed)."""
    if impl not in _KEY_DTYPES:
        _KEY_DTYPES[impl] = jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
    return _KEY_DTYPES[impl]


def build_keys(reader: ShardReader, spec: dict[str, Any], target: Any) -> Any:
    """A saved typed PRNG key array, rebuilt with ``jax.random.wrap_key_data`` in its
    saved implementation: on the default device without a target, else on the
    target's sharding (a target of raw key data, uint32, gets the saved data)."""
    import jax

    impl, leaf = spec["key_impl"], spec["jax"]
    dtype = str_to_dtype(spec["dtype"])
    shape = global_shape_of(reader, leaf)
    whole = [(0, d) for d in shape]
    if not hasattr(target, "shape"):
        data = jax.numpy.asarray(reader.assemble(leaf, whole, dtype))
        return jax.random.wrap_key_data(data, impl=impl)
    if not jax.numpy.issubdtype(target.dtype, jax.dtypes.prng_key):
        return _onto(reader, leaf, dtype, shape, target)
    if target.dtype != _key_dtype(jax, impl):
        raise TreeMismatch(
            f"target for {leaf!r} holds {target.dtype} keys; the checkpoint holds {impl!r} keys"
        )
    n = len(target.shape)
    if tuple(target.shape) != shape[:n] or len(shape) == n:
        raise TreeMismatch(
            f"target for {leaf!r} has key shape {tuple(target.shape)}, saved {shape[:-1]} "
            f"(key data {shape})"
        )
    sharding = getattr(target, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        # Key data is sharded like the keys, the key's own trailing dimensions whole.
        parts = (*sharding.spec, *(None,) * (len(shape) - len(sharding.spec)))
        data_sharding = jax.sharding.NamedSharding(
            sharding.mesh,
            jax.sharding.PartitionSpec(*parts),  # type: ignore[no-untyped-call]
            memory_kind=sharding.memory_kind,
        )
        want = jax.ShapeDtypeStruct(shape, dtype, sharding=data_sharding)  # type: ignore[no-untyped-call]
        keys = jax.random.wrap_key_data(_onto(reader, leaf, dtype, shape, want), impl=impl)
        # wrap_key_data keeps the data's spec (P(None) for one key); state the target's.
        return keys if keys.sharding == sharding else jax.device_put(keys, sharding)
    if sharding is None or not sharding.is_fully_addressable:
        raise TreeMismatch(
            f"target for {leaf!r}: typed keys restore onto a NamedSharding or a sharding "
            f"of this process's devices, not {sharding!r}"
        )
    data = jax.numpy.asarray(reader.assemble(leaf, whole, dtype))
    keys = jax.random.wrap_key_data(data, impl=impl)
    return jax.device_put(keys, sharding)
