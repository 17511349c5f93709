"""Pytree nodes beyond dict/list/tuple, and restore onto a target's own structure.

A node is anything ``jax.tree_util`` flattens (NamedTuples, registered
dataclasses and custom nodes, flax ``struct`` dataclasses and ``nnx.State``,
equinox modules), or, without jax, a NamedTuple, a ``Mapping``, a list/tuple
subclass or a plain ``dataclasses.dataclass``. Its children are named by the
key jax gives them (``DictKey`` and ``GetAttrKey`` by name, ``SequenceKey`` and
``FlattenedIndexKey`` by position); those names become the shard keys
(``opt_state.0.mu.params.w``) and the spec's entries.

The spec stays the one older clients wrote: a node with named children is a
``{"dict": [[name, child], ...]}``, one with positional children a
``{"list": [...]}`` (``"tuple"`` for tuple subclasses), each with ``"type"``
(the class's qualified name, for
people and error messages; restore never imports it). Without a target a node
comes back as that dict or list; with one, :func:`rebuild` pairs the saved
entries with the target's children by name (or by position) and rebuilds each
target node with its own type and static data.

jax is used only when the program has imported it.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptd.core.errors import InvalidArgument, TreeMismatch

from ..leaves.jax_arrays import is_jax_array

Key = str | int
Path = tuple[Key, ...]
LeafBuilder = Callable[[dict[str, Any], Any, Path], Any]
"""Builds a saved leaf from its spec node and its target leaf (None: as saved)."""

CONTAINERS = ("dict", "list", "tuple")

MAX_TREE_DEPTH = 85
"""Deepest nesting of pytree nodes a save may hold (85 dicts one inside the other, a
leaf in the last). The daemon refuses a tree spec nesting deeper than 256 JSON
levels (daemon/api/requests.py), and a named node takes three ``{"dict": [[name,
child]]}``, its leaf one more; the limit also keeps the walks here, which recurse
once per level, far from the interpreter's recursion limit."""


def too_deep(path: Path, saved: bool) -> InvalidArgument:
    """The error for a tree (or a saved spec, if ``saved``) nesting past
    :data:`MAX_TREE_DEPTH` at ``path``: where, the limit, and what to do."""
    where = "".join(f"[{p!r}]" for p in path[:6]) + ("..." if len(path) > 6 else "")
    if saved:
        return InvalidArgument(
            f"the checkpoint's tree nests deeper than {MAX_TREE_DEPTH} levels (at {where}, "
            f"{len(path)} levels down); ckptd's client never saves one this deep, so it "
            "was not written by it: read its rank files directly (ckptd pull)"
        )
    return InvalidArgument(
        f"the tree nests deeper than {MAX_TREE_DEPTH} levels (at {where}, {len(path)} "
        f"levels down); ckptd saves pytrees at most {MAX_TREE_DEPTH} nodes deep: flatten "
        "the deep part (join its keys into one name, or store it as one array)"
    )


class _Skip:
    def __repr__(self) -> str:
        return "SKIP"


SKIP: Any = _Skip()
"""In a restore target: leave this saved subtree (or leaf) out; it comes back as None.
No array of it is built (a jax leaf would otherwise be assembled whole, or fetched
from other nodes' parts): the Orbax manager restores only the items asked for."""

_LEAVES = frozenset({np.ndarray, int, float, bool, str, bytes, complex})


@dataclass(frozen=True, slots=True)
class Node:
    """One level of a pytree node: its children, named, and how to rebuild it."""

    keys: list[Key]
    children: list[Any]
    named: bool
    """Children named (dict keys, field names) rather than numbered by position."""
    type_name: str
    rebuild: Callable[[list[Any]], Any]
    """The same node (type, static fields, aux data) with new children in this order."""
    fields: bool = False
    """Named by attribute (NamedTuple, dataclass, module fields), not by mapping key."""


def path_str(path: Path) -> str:
    """``['opt_state'][0]['mu']`` for people; ``<root>`` for the empty path."""
    return "".join(f"[{p!r}]" for p in path) or "<root>"


_TYPE_NAMES: dict[type, str] = {}


def _type_name(t: type) -> str:
    name = _TYPE_NAMES.get(t)
    if name is None:
        name = _TYPE_NAMES[t] = f"{t.__module__}.{t.__qualname__}"
    return name


def check_key(k: object, path: Path) -> Key:
    """A dict key or field name the spec can hold (JSON keeps str and int apart)."""
    if not isinstance(k, str | int) or isinstance(k, bool):
        raise TypeError(
            f"dict key {k!r} at {path_str(path)} is a {type(k).__name__}; "
            "ckptd stores dict keys that are str or int"
        )
    return k


def node_of(x: Any, path: Path = ()) -> Node | None:
    """``x`` as a pytree node, or None for a leaf (arrays, scalars, None, anything else).

    Builtin dict/list/tuple are the caller's fast path and are not special-cased
    here beyond being handled correctly.
    """
    t = type(x)
    if x is None:
        return None
    jax = sys.modules.get("jax")
    if jax is not None and t not in (dict, list, tuple):
        registry = jax.tree_util.default_registry
        if registry.is_node(t):
            return _jax_node(jax, x, path)
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # ShapeDtypeStruct, torch tensors
        return None
    if isinstance(x, Mapping):
        keys = [check_key(k, path) for k in x]
        return Node(keys, [x[k] for k in keys], True, _type_name(t), _maker(t, dict, keys))
    if isinstance(x, tuple) and hasattr(t, "_fields"):  # a NamedTuple, jax or not
        return Node(list(t._fields), list(x), True, _type_name(t), lambda c: t(*c), True)
    if isinstance(x, list | tuple):
        base = list if isinstance(x, list) else tuple
        return Node(list(range(len(x))), list(x), False, _type_name(t), _maker(t, base, None))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names: list[Key] = [f.name for f in dataclasses.fields(x)]
        children = [getattr(x, str(n)) for n in names]
        return Node(names, children, True, _type_name(t), _setter(x, names), True)
    return None


def _maker(t: type, base: type, keys: list[Key] | None) -> Callable[[list[Any]], Any]:
    """Rebuild a container of type ``t``; its builtin base if ``t`` cannot be called so."""

    def make(children: list[Any]) -> Any:
        items: Any = list(zip(keys, children, strict=True)) if keys is not None else children
        try:
            return t(items)
        except TypeError:
            return base(items)

    return make


def _setter(x: Any, names: list[Key]) -> Callable[[list[Any]], Any]:
    """Rebuild a plain dataclass: a shallow copy with its fields set (frozen ones too,
    as ``dataclasses`` itself does; no ``__init__`` or ``__post_init__`` rerun)."""

    def make(children: list[Any]) -> Any:
        out = copy.copy(x)
        for n, v in zip(names, children, strict=True):
            object.__setattr__(out, str(n), v)
        return out

    return make


def _jax_node(jax: Any, x: Any, path: Path) -> Node:
    tu = jax.tree_util
    # One level: everything below x is a leaf here, None children included. (Not
    # flatten_one_level_with_keys: on jax 0.10 it names every NamedTuple field
    # after the first.)
    pairs, treedef = tu.tree_flatten_with_path(x, is_leaf=lambda c: c is not x)
    entries = [p[0] for p, _ in pairs]
    keys: list[Key] = []
    named, fields = True, False
    for e in entries:
        if isinstance(e, tu.DictKey):
            keys.append(check_key(e.key, path))
        elif isinstance(e, tu.GetAttrKey):
            keys.append(e.name)
            fields = True
        else:  # SequenceKey, FlattenedIndexKey, or a key type of the node's own
            named = False
            break
    if not named or len(set(keys)) != len(keys):
        keys, named, fields = list(range(len(entries))), False, False
    children = [c for _, c in pairs]
    return Node(keys, children, named, _type_name(type(x)), treedef.unflatten, fields)


def container_kind(spec: dict[str, Any]) -> str | None:
    """``"dict"``, ``"list"`` or ``"tuple"`` for a saved node; None for a saved leaf."""
    for kind in CONTAINERS:
        if kind in spec:
            return kind
    return None


def as_saved(spec: Any, leaf: LeafBuilder, path: Path = ()) -> Any:
    """The saved tree without a target: nodes as dicts (by name) or lists (by position)."""
    if not isinstance(spec, dict) or not spec:
        raise ValueError(f"malformed tree spec node at {path_str(path)}: {spec!r:.80}")
    if len(path) >= MAX_TREE_DEPTH and container_kind(spec) is not None:
        raise too_deep(path, saved=True)
    if "dict" in spec:
        return {k: as_saved(v, leaf, (*path, k)) for k, v in spec["dict"]}
    if "list" in spec:
        return [as_saved(v, leaf, (*path, i)) for i, v in enumerate(spec["list"])]
    if "tuple" in spec:
        return tuple(as_saved(v, leaf, (*path, i)) for i, v in enumerate(spec["tuple"]))
    return leaf(spec, None, path)


def rebuild(spec: Any, target: Any, leaf: LeafBuilder, path: Path = ()) -> Any:
    """The saved tree in ``target``'s structure: each target node rebuilt with its own
    type and static data around the saved children, each leaf built by ``leaf`` with
    its target leaf. A ``None`` in the target takes what was saved there, a
    :data:`SKIP` leaves it out (None).

    Raises :class:`TreeMismatch` naming the path where the two differ.
    """
    if target is None:
        return as_saved(spec, leaf, path)
    if target is SKIP:
        return None
    if not isinstance(spec, dict) or not spec:
        raise ValueError(f"malformed tree spec node at {path_str(path)}: {spec!r:.80}")
    if len(path) >= MAX_TREE_DEPTH and container_kind(spec) is not None:
        raise too_deep(path, saved=True)
    t = type(target)
    if t is dict and "dict" in spec:  # the common case, in as few steps as possible
        saved = dict(spec["dict"])
        if saved.keys() != target.keys():
            _same_names(saved, list(target), path)
        return {k: rebuild(saved[k], v, leaf, (*path, k)) for k, v in target.items()}
    kind = container_kind(spec)
    node: Node | None
    if t is dict:
        keys = list(target)
        node = Node(
            keys, list(target.values()), True, "dict", lambda c: dict(zip(keys, c, strict=True))
        )
    elif t is list or t is tuple:
        node = Node(list(range(len(target))), list(target), False, t.__name__, t)
    elif t in _LEAVES or is_jax_array(target):  # most targets: no need to ask further
        node = None
    else:
        node = node_of(target, path)
    if kind is None:
        if node is not None:
            raise TreeMismatch(
                f"at {path_str(path)} the checkpoint has a leaf and the restore target a "
                f"{node.type_name} node; pass a target with the saved tree's structure"
            )
        return leaf(spec, target, path)
    if node is None:
        raise TreeMismatch(
            f"at {path_str(path)} the checkpoint has a {spec.get('type', kind)} node and the "
            f"restore target a leaf of type {t.__name__}; pass a target with the saved "
            "tree's structure"
        )
    saved = _saved_children(spec, kind, node, path)
    children = [
        rebuild(saved[k], c, leaf, (*path, k))
        for k, c in zip(node.keys, node.children, strict=True)
    ]
    return node.rebuild(children)


def _saved_children(spec: dict[str, Any], kind: str, node: Node, path: Path) -> dict[Key, Any]:
    """The saved entries under the target node's child names; a mismatch raises.

    Named saved entries pair with named target children by name. By position: a
    saved list/tuple with a list/tuple target, or with a NamedTuple/dataclass
    target (older checkpoints stored NamedTuples as tuples), and a saved node with
    fields with a positional target.
    """
    entries = spec[kind]
    if not entries and not node.keys:  # EmptyState(), (), {}: nothing to pair
        return {}
    if kind == "dict" and node.named:
        saved: dict[Key, Any] = dict(entries)
        _same_names(saved, node.keys, path)
        return saved
    elif (kind != "dict" and (not node.named or node.fields)) or (
        kind == "dict" and "type" in spec
    ):
        if len(entries) != len(node.keys):
            raise TreeMismatch(
                f"at {path_str(path)} the checkpoint has {len(entries)} children and the "
                f"restore target's {node.type_name} has {len(node.keys)}; pass a target "
                "with the saved tree's structure"
            )
        values = [v for _, v in entries] if kind == "dict" else entries
        return dict(zip(node.keys, values, strict=True))
    else:
        raise TreeMismatch(
            f"at {path_str(path)} the checkpoint has a {spec.get('type', kind)} and the "
            f"restore target a {node.type_name}; pass a target with the saved tree's structure"
        )


def _same_names(saved: dict[Key, Any], names: list[Key], path: Path) -> None:
    """Raise :class:`TreeMismatch` unless the target's child ``names`` are the saved ones."""
    known = set(names)
    missing = [k for k in saved if k not in known]
    if missing:
        raise TreeMismatch(
            f"the restore target has no entry {missing[0]!r} at {path_str(path)} where the "
            f"checkpoint has one ({len(missing)} such); pass a target with the saved tree's "
            "structure"
        )
    extra = [k for k in names if k not in saved]
    if extra:
        raise TreeMismatch(
            f"the checkpoint has no entry {extra[0]!r} at {path_str(path)} where the restore "
            f"target has one ({len(extra)} such); it was saved from another structure"
        )
