"""Pytree flattening: nested dict/list/tuple into array leaves and a JSON spec.

Array leaves (numpy arrays, numpy scalars, anything with ``__array__``) become
shards with keys derived from their path; JSON-able leaves (None, bool, int,
float, str) stay in the spec, which the daemon stores in the manifest.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ckptd.core.format import dtype_to_str

from .jax_arrays import is_jax_array

MAX_KEY_BYTES = 1024
_UNSAFE = re.compile(r"[/\\\x00-\x1f\x7f]")


def _component(k: object) -> str:
    s = _UNSAFE.sub("_", str(k)) or "_"
    return s.replace("..", "._")


def _key_for(path: tuple[object, ...], used: set[str]) -> str:
    key = ".".join(_component(p) for p in path) or "root"
    key = key.replace("..", "._")
    if key == "__metadata__":
        key = "_metadata_"
    if len(key.encode()) > MAX_KEY_BYTES - 24:
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        key = key.encode()[: MAX_KEY_BYTES - 40].decode(errors="ignore") + "~" + digest
    base, n = key, 1
    while key in used:
        key, n = f"{base}~{n}", n + 1
    used.add(key)
    return key


def _path_str(path: tuple[object, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path) or "<root>"


def flatten(tree: Any) -> tuple[Any, list[tuple[str, np.ndarray]]]:
    """Split ``tree`` into a JSON spec and ``(key, array)`` pairs in a stable order."""
    arrays: list[tuple[str, np.ndarray]] = []
    used: set[str] = set()

    def walk(node: Any, path: tuple[object, ...]) -> Any:
        if isinstance(node, Mapping):
            items = []
            for k, v in node.items():
                if not isinstance(k, str | int) or isinstance(k, bool):
                    raise TypeError(
                        f"dict key {k!r} at {_path_str(path)} is a {type(k).__name__}; "
                        "ckptd stores dict keys that are str or int"
                    )
                items.append([k, walk(v, (*path, k))])
            return {"dict": items}
        if isinstance(node, list | tuple):
            kind = "tuple" if isinstance(node, tuple) else "list"
            return {kind: [walk(v, (*path, i)) for i, v in enumerate(node)]}
        if is_jax_array(node):
            key = _key_for(path, used)
            arrays.append((key, node))  # the client saves its addressable shards
            return {"jax": key, "dtype": dtype_to_str(np.dtype(node.dtype))}
        # Before the Python scalars: np.float64 is a subclass of float but is an array leaf.
        if isinstance(node, np.ndarray | np.generic) or (
            hasattr(node, "__array__") and not isinstance(node, bool | int | float | str)
        ):
            arr = np.asarray(node)
            if arr.dtype.hasobject:
                raise TypeError(
                    f"array at {_path_str(path)} has dtype object; ckptd stores fixed-size "
                    "dtypes only (convert it, or store its items as JSON leaves)"
                )
            key = _key_for(path, used)
            arrays.append((key, arr))
            spec: dict[str, Any] = {"array": key}
            if isinstance(node, np.generic):
                spec["scalar"] = True
            return spec
        if node is None or isinstance(node, bool | int | float | str):
            if isinstance(node, int) and not isinstance(node, bool) and abs(node) >= 2**63:
                return {"bigint": str(node)}
            return {"value": node}
        raise TypeError(
            f"leaf at {_path_str(path)} has type {type(node).__name__}, which ckptd cannot "
            "store; use numpy arrays, dict/list/tuple, or None/bool/int/float/str"
        )

    return walk(tree, ()), arrays


def unflatten(
    spec: Any,
    arrays: Mapping[str, np.ndarray],
    jax_leaf: Callable[[dict[str, Any], Any], Any] | None = None,
    target: Any = None,
) -> Any:
    """Rebuild the tree from its spec and the restored arrays.

    ``jax_leaf(spec_node, target_node)`` builds saved jax leaves; ``target`` is
    walked alongside the spec (same structure) to hand each its target leaf.
    """
    if not isinstance(spec, dict) or len(spec) < 1:
        raise ValueError(f"malformed tree spec node: {spec!r:.80}")

    def sub(key: Any) -> Any:
        if target is None:
            return None
        try:
            return target[key]
        except (KeyError, IndexError, TypeError):
            raise ValueError(
                f"the restore target has no entry {key!r} where the checkpoint has one; "
                "pass a target with the saved tree's structure"
            ) from None

    if "dict" in spec:
        return {k: unflatten(v, arrays, jax_leaf, sub(k)) for k, v in spec["dict"]}
    if "list" in spec:
        return [unflatten(v, arrays, jax_leaf, sub(i)) for i, v in enumerate(spec["list"])]
    if "tuple" in spec:
        return tuple(unflatten(v, arrays, jax_leaf, sub(i)) for i, v in enumerate(spec["tuple"]))
    if "jax" in spec:
        if jax_leaf is None:
            raise ValueError("this checkpoint holds jax arrays; restore it with ckptd.client")
        return jax_leaf(spec, target)
    if "value" in spec:
        return spec["value"]
    if "bigint" in spec:
        return int(spec["bigint"])
    if "array" in spec:
        arr = arrays[spec["array"]]
        return arr[()] if spec.get("scalar") else arr
    raise ValueError(f"malformed tree spec node: {spec!r:.80}")
