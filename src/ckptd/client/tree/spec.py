"""Pytree flattening: a tree into array leaves and a JSON spec, and back.

Nodes are dict/list/tuple and, through :mod:`.nodes`, every other pytree node
(NamedTuples, dataclasses, what ``jax.tree_util`` flattens). Array leaves (numpy
arrays and scalars, ``jax.Array`` incl. typed PRNG keys, anything with
``__array__``) become shards with keys derived from their path; JSON-able leaves
(None, bool, int, float, str) stay in the spec, which the daemon stores in the
manifest. Spec nodes: ``{"dict": [[key, node], ...]}``, ``{"list": [...]}``,
``{"tuple": [...]}`` (nodes other than builtins add ``"type"``), leaves
``{"array": key}`` (a torch tensor adds ``"torch": its torch dtype name, or ""``),
``{"jax": key, "dtype": ...}`` (typed keys add ``"key_impl"``), ``{"value": v}``,
``{"bigint": "..."}``, ``{"static": name}``.

torch tensors (when the program has imported torch) are saved from a view of
their memory (any dtype, ``requires_grad``, strided; a CUDA tensor is copied to
the host first) and come back as torch tensors over the restored memory, or are
copied in place into the target's tensors (a model's state dict).

A function or class among the leaves (an equinox module's activation) is a
static part of a model, not state: like ``equinox.tree_serialise_leaves`` it is
not saved (``{"static": name}`` records what was there), and a restore takes it
from the target (``None`` without one).
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ckptd.core.errors import InvalidArgument, TreeMismatch
from ckptd.core.format import dtype_to_str

from ..leaves.jax_arrays import is_jax_array, key_data_of
from .nodes import MAX_TREE_DEPTH, Path, check_key, node_of, path_str, rebuild, too_deep

MAX_KEY_BYTES = 1024
_UNSAFE = re.compile(r"[/\\\x00-\x1f\x7f]")


def _component(k: object) -> str:
    s = _UNSAFE.sub("_", str(k)) or "_"
    return s.replace("..", "._")


_LEAF = object()
"""No key: the path given is the leaf's own."""

_STR_COMPONENTS: dict[str, str] = {}
"""The path component of each str key seen, across saves: a training loop saves the
same keys every time, and the regex cost ~1 us a leaf of a thousand-tensor save."""
_MAX_CACHED = 1 << 17


def _key_for(joined: str, used: set[str]) -> str:
    """The shard key of a leaf whose sanitized path components joined with dots are
    ``joined``: unique in ``used``, no ``..``, bounded length."""
    key = joined.replace("..", "._") if ".." in joined else joined
    if not key:
        key = "root"
    elif key == "__metadata__":
        key = "_metadata_"
    # (A str of n characters encodes to at most 4n bytes: most keys skip the encode.)
    if len(key) * 4 > MAX_KEY_BYTES - 24 and len(key.encode()) > MAX_KEY_BYTES - 24:
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        key = key.encode()[: MAX_KEY_BYTES - 40].decode(errors="ignore") + "~" + digest
    if key in used:
        base, n = key, 1
        while key in used:
            key, n = f"{base}~{n}", n + 1
    used.add(key)
    return key


def torch_tensor_type() -> Any:
    """``torch.Tensor`` if the program imported torch (ckptd never imports it itself)."""
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


def flatten(
    tree: Any,
    values: list[Any] | None = None,
    tensors: dict[str, Any] | None = None,
    token: Callable[[Any], Any] | None = None,
    keep_device: bool = False,
) -> tuple[Any, list[tuple[str, Any]]]:
    """Split ``tree`` into a JSON spec and ``(key, array)`` pairs in a stable order.

    The arrays are numpy arrays, or ``jax.Array`` (the client saves their
    addressable shards; a typed PRNG key array is replaced by its key data).
    ``values``: if given, every JSON leaf's value is appended to it in order.
    ``tensors``: if given, each torch tensor's ``token(tensor)`` (None without
    ``token``), by key: taken here, in the one pass over a thousand tensors.
    ``keep_device``: a CUDA tensor is a :class:`~ckptd.client.leaves.device.DeviceTensor`
    (a save copies it from the device into its lease), not a copy in host memory.
    """
    walker = _Flatten(values, tensors, token, keep_device)
    return walker.walk(tree, (), ""), walker.arrays


class _Flatten:
    """One flatten: the arrays found so far, the keys used, and the walk. The common
    leaves (numpy arrays and torch tensors in a dict: a transformer's state is
    thousands) are handled inline in :meth:`walk`; the rest in :meth:`leaf`."""

    __slots__ = (
        "arrays",
        "keep_device",
        "names",
        "tensor_type",
        "tensors",
        "to_array",
        "token",
        "used",
        "values",
    )

    def __init__(
        self,
        values: list[Any] | None,
        tensors: dict[str, Any] | None,
        token: Callable[[Any], Any] | None,
        keep_device: bool,
    ) -> None:
        self.arrays: list[tuple[str, Any]] = []
        self.used: set[str] = set()
        self.names: dict[object, str] = {}  # components of other keys seen (ints: layers)
        self.tensor_type = torch_tensor_type()
        self.to_array: Callable[[Any, bool], tuple[Any, str]] | None = None
        if self.tensor_type is not None:
            # Imported once here (torch is imported: the program has it), not at each
            # leaf: a relative import statement costs 3 us even when it is loaded.
            from ..leaves.torch_tensors import to_array

            self.to_array = to_array
        self.values, self.tensors, self.token = values, tensors, token
        self.keep_device = keep_device

    def join(self, prefix: str, k: object) -> str:
        """The shard key prefix of ``k`` under ``prefix`` (components cached)."""
        if type(k) is str:
            c = _STR_COMPONENTS.get(k)
            if c is None:
                if len(_STR_COMPONENTS) >= _MAX_CACHED:
                    _STR_COMPONENTS.clear()
                c = _STR_COMPONENTS[k] = _component(k)
        else:
            c = self.names.get(k)
            if c is None:
                c = self.names[k] = _component(k)
        return f"{prefix}.{c}" if prefix else c

    def tensor(self, t: Any, path: Path, prefix: str, k: Any = _LEAF) -> dict[str, Any]:
        """A torch tensor leaf at ``path``, or under ``k`` of the dict at ``path``
        (the path of a leaf is built only for an error: a thousand leaves a save)."""
        assert self.to_array is not None
        try:
            arr, torch_dtype = self.to_array(t, self.keep_device)
        except InvalidArgument as exc:
            where: Path = path if k is _LEAF else (*path, k)
            raise InvalidArgument(f"at {path_str(where)}: {exc}") from None
        key = _key_for(prefix, self.used)
        self.arrays.append((key, arr))
        if self.tensors is not None:  # its change token (changes.py)
            self.tensors[key] = None if self.token is None else self.token(t)
        return {"array": key, "torch": torch_dtype}

    # The path tuple is for error messages; the joined string builds the shard key
    # incrementally instead of joining every component again at each leaf.
    def walk(self, node: Any, path: Path, prefix: str) -> Any:
        """The spec of ``node`` at ``path`` (its shard key prefix ``prefix``)."""
        t = type(node)
        if t is dict:
            if len(path) >= MAX_TREE_DEPTH:
                raise too_deep(path, saved=False)
            arrays, used, join, tensor_type = self.arrays, self.used, self.join, self.tensor_type
            items = []
            for k, v in node.items():
                if type(k) is not str:
                    check_key(k, path)
                if type(v) is np.ndarray and not v.dtype.hasobject:
                    # The common leaf inline (a transformer's state is thousands).
                    key = _key_for(join(prefix, k), used)
                    arrays.append((key, v))
                    items.append([k, {"array": key}])
                elif tensor_type is not None and isinstance(v, tensor_type):
                    # And a torch one (a walk() call per leaf cost 2 us of 7).
                    items.append([k, self.tensor(v, path, join(prefix, k), k)])
                else:
                    items.append([k, self.walk(v, (*path, k), join(prefix, k))])
            return {"dict": items}
        if t is list or t is tuple:
            if len(path) >= MAX_TREE_DEPTH:
                raise too_deep(path, saved=False)
            kind = "tuple" if t is tuple else "list"
            walk, join = self.walk, self.join
            return {kind: [walk(v, (*path, i), join(prefix, i)) for i, v in enumerate(node)]}
        if t is np.ndarray and not node.dtype.hasobject:
            # The common leaf first (is_jax_array is an ABC check).
            key = _key_for(prefix, self.used)
            self.arrays.append((key, node))
            return {"array": key}
        if self.tensor_type is not None and isinstance(node, self.tensor_type):
            return self.tensor(node, path, prefix)
        return self.leaf(node, path, prefix)

    def leaf(self, node: Any, path: Path, prefix: str) -> Any:
        """Every other node: a jax array, a numpy scalar, a JSON value, a pytree node
        of another type, anything with ``__array__``, or a static callable."""
        if is_jax_array(node):
            key = _key_for(prefix, self.used)
            if isinstance(node.dtype, np.dtype):
                self.arrays.append((key, node))  # the client saves its addressable shards
                return {"jax": key, "dtype": dtype_to_str(np.dtype(node.dtype))}
            data, impl = key_data_of(node, path_str(path))  # a typed PRNG key array
            self.arrays.append((key, data))
            return {"jax": key, "dtype": dtype_to_str(np.dtype(data.dtype)), "key_impl": impl}
        # Before the Python scalars: np.float64 is a subclass of float but is an array leaf.
        if isinstance(node, np.ndarray | np.generic):
            return self.array(node, path, prefix)
        if node is None or isinstance(node, bool | int | float | str):
            if self.values is not None:
                self.values.append(node)
            if isinstance(node, int) and not isinstance(node, bool) and abs(node) >= 2**63:
                return {"bigint": str(node)}
            return {"value": node}
        # Before __array__: some nodes (flax nnx Variables) have one too.
        n = node_of(node, path)
        if n is not None:
            if len(path) >= MAX_TREE_DEPTH:
                raise too_deep(path, saved=False)
            subs = [
                self.walk(c, (*path, k), self.join(prefix, k))
                for k, c in zip(n.keys, n.children, strict=True)
            ]
            if n.named:
                return {
                    "dict": [[k, s] for k, s in zip(n.keys, subs, strict=True)],
                    "type": n.type_name,
                }
            return {"tuple" if isinstance(node, tuple) else "list": subs, "type": n.type_name}
        if hasattr(node, "__array__"):
            return self.array(node, path, prefix)
        t = type(node)
        if callable(node):
            name = getattr(node, "__qualname__", None) or t.__qualname__
            return {"static": f"{getattr(node, '__module__', None) or t.__module__}.{name}"}
        raise TypeError(
            f"leaf at {path_str(path)} has type {t.__name__}, which ckptd cannot store; use "
            "arrays, pytree nodes (dict/list/tuple, NamedTuples, dataclasses, nodes "
            "jax.tree_util flattens) or None/bool/int/float/str"
        )

    def array(self, node: Any, path: Path, prefix: str) -> dict[str, Any]:
        """An array leaf other than a plain numpy array (a scalar, ``__array__``)."""
        arr = np.asarray(node)
        if arr.dtype.hasobject:
            raise TypeError(
                f"array at {path_str(path)} has dtype object; ckptd stores fixed-size "
                "dtypes only (convert it, or store its items as JSON leaves)"
            )
        key = _key_for(prefix, self.used)
        self.arrays.append((key, arr))
        spec: dict[str, Any] = {"array": key}
        if isinstance(node, np.generic):
            spec["scalar"] = True
        return spec


def unflatten(
    spec: Any,
    arrays: Mapping[str, np.ndarray],
    jax_leaf: Callable[[dict[str, Any], Any], Any] | None = None,
    target: Any = None,
) -> Any:
    """Rebuild the tree from its spec and the restored arrays.

    Without ``target``: dicts, lists and tuples as saved (other nodes as dicts by
    field name, or lists). With one: the target's own structure and node types
    (:func:`ckptd.client.tree.nodes.rebuild`), or :class:`TreeMismatch` naming the
    path where they differ. ``jax_leaf(spec_node, target_leaf)`` builds saved jax
    leaves.
    """

    def leaf(s: dict[str, Any], t: Any, path: Path) -> Any:
        if "jax" in s:
            if jax_leaf is None:
                raise ValueError("this checkpoint holds jax arrays; restore it with ckptd.client")
            try:
                return jax_leaf(s, t)
            except TreeMismatch as exc:
                raise TreeMismatch(f"at {path_str(path)}: {exc}") from None
        if "value" in s:
            return s["value"]
        if "bigint" in s:
            return int(s["bigint"])
        if "static" in s:  # a function of a model: not saved; the target's (None without)
            return t
        if "array" in s:
            arr = arrays[s["array"]]
            shape = getattr(t, "shape", None)
            if shape is not None and tuple(shape) != arr.shape:
                raise TreeMismatch(
                    f"at {path_str(path)} the restore target has shape {tuple(shape)} and the "
                    f"checkpoint {arr.shape}"
                )
            if isinstance(t, np.ndarray | np.generic) and t.dtype != arr.dtype:
                raise TreeMismatch(
                    f"at {path_str(path)} the restore target has dtype {t.dtype} and the "
                    f"checkpoint {arr.dtype}; pass a target of the saved dtype"
                )
            tensor_type = torch_tensor_type()
            if tensor_type is not None and isinstance(t, tensor_type):
                from ..leaves.torch_tensors import load_into

                return load_into(t, arr, s.get("torch", ""))
            if "torch" in s:
                from ..leaves.torch_tensors import to_tensor

                return to_tensor(arr, s["torch"])
            return arr[()] if s.get("scalar") else arr
        raise ValueError(f"malformed tree spec node at {path_str(path)}: {s!r:.80}")

    return rebuild(spec, target, leaf)
