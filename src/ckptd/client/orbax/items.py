"""Orbax checkpoint args as ckptd trees: what :class:`ckptd.client.orbax.CheckpointManager`
stores for each item of an ``ocp.args.Composite``, and the restore target it builds
from the restore args.

A step is one ckptd tree ``{item name: item}`` of its pytree items (``StandardSave``,
``PyTreeSave``; each process saves the shards it can address), and JSON in the
step's metadata under ``"orbax"``: each item's kind, the ``JsonSave`` items,
``custom_metadata`` and the metrics. Restore args become a ckptd restore target:
``ArrayRestoreArgs(sharding=...)`` (MaxText's) and ``jax.ShapeDtypeStruct`` leaves
with a sharding restore as ``jax.Array`` on that sharding; items not asked for are
not built (:data:`ckptd.client.tree.nodes.SKIP`).

Only imported when the manager is: it imports Orbax and jax.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp  # type: ignore[import-untyped]

from ckptd.core.errors import InvalidArgument, TreeMismatch
from ckptd.core.format import str_to_dtype
from ckptd.core.shard_table import rows

from ..shards import leaf_of
from ..tree.nodes import SKIP, as_saved

META = "orbax"
"""The key of the manager's record in a step's ckptd metadata."""
DEFAULT_ITEM = "default"
"""Orbax's name for the one item of a manager without ``item_names`` (and ours)."""
PYTREE, JSON = "pytree", "json"
SAVE_KINDS = "StandardSave, PyTreeSave or JsonSave"


@dataclass
class SavedStep:
    """What a step's manifest says about its Orbax items (read before restoring it)."""

    step: int
    kinds: dict[str, str]
    """Each item's name and kind (``"pytree"`` or ``"json"``), as saved."""
    spec: Any
    """The rank's tree spec: one entry per pytree item."""
    manifest: dict[str, Any]
    json_items: dict[str, Any] = field(default_factory=dict)
    custom_metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    default_item: bool = False
    """Saved without a Composite (a manager with one unnamed item)."""

    @classmethod
    def of(cls, step: int, manifest: dict[str, Any], rank: int) -> SavedStep:
        """From a step's parsed ``manifest.json`` (this node's part), for ``rank``."""
        record = next(r for r in manifest["ranks"] if r["rank"] == rank)
        spec = record["tree"]
        meta = (manifest.get("metadata") or {}).get(META)
        if meta is None:  # saved by Client.save: each top-level entry is a pytree item
            names = [k for k, _ in spec.get("dict", [])]
            return cls(step, dict.fromkeys(names, PYTREE), spec, manifest)
        return cls(
            step,
            dict(meta["items"]),
            spec,
            manifest,
            dict(meta.get("json") or {}),
            dict(meta.get("custom_metadata") or {}),
            dict(meta.get("metrics") or {}),
            bool(meta.get("default_item")),
        )

    def item_specs(self) -> dict[str, Any]:
        """Each pytree item's spec node."""
        return dict(self.spec.get("dict", []))


def items_of(args: Any, default_item: bool) -> dict[str, Any]:
    """The named items of save or restore ``args`` (a single one is ``"default"``)."""
    if isinstance(args, ocp.args.Composite):
        if default_item:
            raise InvalidArgument(
                "this CheckpointManager has one unnamed item: pass its args (such as "
                "ocp.args.StandardSave(state)) without a Composite, or create the manager "
                "with item_names"
            )
        return dict(args.items())
    if not isinstance(args, ocp.args.CheckpointArgs):
        raise InvalidArgument(
            f"args must be ocp.args.Composite(...) or one ocp.args item, not {type(args).__name__}"
        )
    if not default_item:
        raise InvalidArgument(
            "this CheckpointManager has named items (item_names): pass "
            "ocp.args.Composite(name=...), not one item"
        )
    return {DEFAULT_ITEM: args}


def to_save(
    items: dict[str, Any],
    default_item: bool,
    custom_metadata: dict[str, Any] | None,
    metrics: dict[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tree, metadata)`` to hand to ``Client.save`` for these save items."""
    tree: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    json_items: dict[str, Any] = {}
    for name, a in items.items():
        if isinstance(a, ocp.args.StandardSave | ocp.args.PyTreeSave):
            tree[name], kinds[name] = a.item, PYTREE
        elif isinstance(a, ocp.args.JsonSave):
            json_items[name], kinds[name] = _json(a.item, f"JsonSave item {name!r}"), JSON
        else:
            raise InvalidArgument(
                f"item {name!r} is a {type(a).__name__}; ckptd's CheckpointManager saves "
                f"{SAVE_KINDS} items (keep Orbax's own CheckpointManager for the others, "
                "such as grain's data iterator)"
            )
    meta = {
        "items": kinds,
        "json": json_items,
        "custom_metadata": _json(custom_metadata or {}, "custom_metadata"),
        "metrics": _json(metrics or {}, "metrics"),
        "default_item": default_item,
    }
    return tree, {META: meta}


def _json(value: Any, what: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{what} is not JSON-serialisable: {exc}") from None
    return value


def numeric_metrics(metrics: dict[str, Any] | None) -> dict[str, float] | None:
    """The metrics ckptd's retention can rank by (``KeepBest``): the numeric ones."""
    if not metrics:
        return None
    out = {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(k, str) and isinstance(v, int | float | np.number) and not isinstance(v, bool)
    }
    return out or None


@dataclass
class RestorePlan:
    """The ckptd restore target for some restore args, and how to hand back the result."""

    target: dict[str, Any]
    names: list[str]
    """The items asked for, in order."""
    partial: dict[str, list[tuple[tuple[Any, ...], Any]]] = field(default_factory=dict)
    """Per item: paths the target has and the step lacks (put back as given)."""
    dropped: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)
    """Per item: paths the step has and a partial target lacks (taken out again)."""


def plan_restore(items: dict[str, Any] | None, saved: SavedStep) -> RestorePlan:
    """The target for restoring ``items`` (name -> restore args or None; None: every
    saved item, as saved) from ``saved``."""
    specs = saved.item_specs()
    names = list(saved.kinds) if items is None else list(items)
    target: dict[str, Any] = dict.fromkeys(specs, SKIP)
    plan = RestorePlan(target, names)
    for name in names:
        if name not in saved.kinds:
            raise InvalidArgument(
                f"step {saved.step} has no item {name!r} (it has {sorted(saved.kinds)})"
            )
        a = None if items is None else items[name]
        kind = saved.kinds[name]
        if kind == JSON:
            if a is not None and not isinstance(a, ocp.args.JsonRestore):
                raise InvalidArgument(
                    f"item {name!r} of step {saved.step} was saved with JsonSave; restore it "
                    f"with ocp.args.JsonRestore(), not {type(a).__name__}"
                )
            continue
        if a is not None and not isinstance(a, ocp.args.StandardRestore | ocp.args.PyTreeRestore):
            raise InvalidArgument(
                f"item {name!r} of step {saved.step} is a pytree; restore it with "
                f"ocp.args.StandardRestore or ocp.args.PyTreeRestore, not {type(a).__name__}"
            )
        t = _target(a)
        if isinstance(a, ocp.args.PyTreeRestore) and a.partial_restore and t is not None:
            missing: list[tuple[tuple[Any, ...], Any]] = []
            dropped: list[tuple[Any, ...]] = []
            t = _align(specs[name], t, missing, dropped, ())
            # Put back what the caller gave (a ShapeDtypeStruct stays one, as in Orbax).
            given = a.item if a.item is not None else {}
            plan.partial[name] = [(path, _at(given, path, leaf)) for path, leaf in missing]
            plan.dropped[name] = dropped
        target[name] = t
    return plan


def finish_restore(restored: Any, plan: RestorePlan, saved: SavedStep) -> dict[str, Any]:
    """The items asked for, from the restored tree and the step's JSON items."""
    out: dict[str, Any] = {}
    for name in plan.names:
        if saved.kinds[name] == JSON:
            out[name] = saved.json_items.get(name)
            continue
        value = restored[name]
        for path in plan.dropped.get(name, []):
            _parent(value, path).pop(path[-1], None)
        for path, leaf in plan.partial.get(name, []):
            _parent(value, path)[path[-1]] = leaf
        out[name] = value
    return out


def _at(tree: Any, path: tuple[Any, ...], default: Any) -> Any:
    for k in path:
        if not isinstance(tree, dict) or k not in tree:
            return default
        tree = tree[k]
    return tree


def _parent(tree: Any, path: tuple[Any, ...]) -> Any:
    for k in path[:-1]:
        tree = tree[k]
    return tree


def _target(a: Any) -> Any:
    """The ckptd target of one pytree item's restore args (None: as saved)."""
    if a is None:
        return None
    item = a.item
    restore_args = getattr(a, "restore_args", None)
    fallback = getattr(a, "fallback_sharding", None)
    transforms = getattr(a, "transforms", None)
    if transforms:
        raise InvalidArgument(
            "PyTreeRestore transforms are not supported by ckptd's CheckpointManager; "
            "restore the saved structure and transform it yourself"
        )
    if restore_args is None:
        if item is None:
            return None
        return jax.tree_util.tree_map(lambda x: _leaf(x, None, fallback), item)
    if item is None:
        return jax.tree_util.tree_map(
            lambda r: _leaf(None, r, fallback), restore_args, is_leaf=_is_restore_args
        )
    return jax.tree_util.tree_map(
        lambda x, r: _leaf(x, r, fallback),
        item,
        restore_args,
        is_leaf=lambda x: x is None,
    )


def _is_restore_args(x: Any) -> bool:
    return isinstance(x, ocp.RestoreArgs)


def _leaf(x: Any, r: Any, fallback: Any) -> Any:
    """One target leaf: ``x`` (the item's leaf) and ``r`` (its RestoreArgs) combined."""
    sharding = _sharding(r) if r is not None else None
    if r is not None and sharding is None and _restores_numpy(r):
        return None  # RestoreArgs(restore_type=np.ndarray): numpy, as saved
    if sharding is None:
        if isinstance(x, jax.Array | np.ndarray | np.generic):
            return x  # its own sharding (jax), or numpy
        sharding = getattr(x, "sharding", None) or fallback
    shape = getattr(r, "global_shape", None) or getattr(x, "shape", None)
    dtype = getattr(r, "dtype", None) or getattr(x, "dtype", None)
    if sharding is None or shape is None or dtype is None:
        return x if not hasattr(x, "shape") else None  # no sharding: numpy, as saved
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)  # type: ignore[no-untyped-call]


def _sharding(r: Any) -> Any:
    """The ``jax.sharding.Sharding`` an ArrayRestoreArgs names (None if none)."""
    s = getattr(r, "sharding", None)
    if s is not None and not isinstance(s, jax.sharding.Sharding):
        # ShardingMetadata, or a jax Format (layout) holding a sharding
        s = s.to_jax_sharding() if hasattr(s, "to_jax_sharding") else getattr(s, "sharding", None)
    if s is None and getattr(r, "mesh", None) is not None:
        s = jax.sharding.NamedSharding(r.mesh, r.mesh_axes)
    return s


def _restores_numpy(r: Any) -> bool:
    kind = getattr(r, "restore_type", None)
    return isinstance(kind, type) and issubclass(kind, np.ndarray)


def _align(
    spec: Any,
    target: Any,
    missing: list[tuple[tuple[Any, ...], Any]],
    dropped: list[tuple[Any, ...]],
    path: tuple[Any, ...],
) -> Any:
    """A partial restore's target in the saved structure (dict nodes): saved entries it
    lacks are skipped, its entries the step lacks are set aside to be put back."""
    if type(target) is not dict or not isinstance(spec, dict) or "dict" not in spec:
        return target  # other nodes must match: ckptd's rebuild names any difference
    saved = dict(spec["dict"])
    out: dict[Any, Any] = {}
    for k, child in saved.items():
        if k in target:
            out[k] = _align(child, target[k], missing, dropped, (*path, k))
        else:
            out[k] = SKIP
            dropped.append((*path, k))
    for k, v in target.items():
        if k not in saved:
            missing.append(((*path, k), v))
    return out


def item_metadata(saved: SavedStep) -> dict[str, Any]:
    """Each item's metadata: pytree items as trees of ``jax.ShapeDtypeStruct`` (global
    shape, dtype) and JSON-able leaves, JSON items as saved."""
    arrays: dict[str, Any] = {}
    for s in rows(saved.manifest):
        dtype = str_to_dtype(s["dtype"])
        sds = jax.ShapeDtypeStruct
        arrays.setdefault(s["key"], sds(tuple(s["shape"]), dtype))  # type: ignore[no-untyped-call]
        whole = sds(tuple(s["global_shape"]), dtype)  # type: ignore[no-untyped-call]
        arrays.setdefault(leaf_of(s["key"]), whole)

    def leaf(spec: dict[str, Any], _target: Any, path: tuple[Any, ...]) -> Any:
        key = spec.get("jax") or spec.get("array")
        if key is not None:
            if key not in arrays:
                raise TreeMismatch(f"step {saved.step}: no shard of {key!r} on this node")
            return arrays[key]
        return spec.get("value")

    specs = saved.item_specs()
    return {
        name: saved.json_items.get(name) if kind == JSON else as_saved(specs[name], leaf)
        for name, kind in saved.kinds.items()
    }


__all__ = [
    "DEFAULT_ITEM",
    "META",
    "RestorePlan",
    "SavedStep",
    "finish_restore",
    "item_metadata",
    "items_of",
    "numeric_metrics",
    "ocp",
    "plan_restore",
    "to_save",
]
