"""A tree matched against the spec of the last save: its array leaves without
flattening it again.

A training loop saves a tree of the same structure every time. Flattening it builds
the spec anew (a key derived from each path, a dict per leaf) only to find it equal
to the last one; on a LoRA-shaped state of ~900 arrays that was half of what an
incremental save blocks the trainer for. :func:`match` walks the tree beside the
last spec instead and takes each leaf's key from it. Anything it does not see exactly
as the spec has it (another key or order, a changed JSON value, a leaf of another
kind, a node type other than dict/list/tuple) is not matched, and the caller
flattens the tree as usual, so a match gives what :func:`~.spec.flatten`
would have given.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ckptd.core.errors import InvalidArgument
from ckptd.core.format import dtype_to_str

from .spec import torch_tensor_type

_DTYPE_NAMES: dict[np.dtype, str] = {}
"""``dtype_to_str`` of each dtype a jax leaf had (a handful)."""


View = tuple[Any, tuple[Any, ...], np.ndarray]
"""A torch tensor's numpy view as a save took it: ``(weak reference to its storage,
where it lay in it, the view)``, the first two as in its token (changes.py)."""


class _Memory:
    """What :func:`unowned` hands numpy: where an array's bytes are, and nothing else."""

    __slots__ = ("__array_interface__",)

    def __init__(self, interface: dict[str, Any]) -> None:
        self.__array_interface__ = interface


def unowned(arr: np.ndarray) -> np.ndarray | None:
    """A view of ``arr``'s memory holding no reference to whatever owns it (None for a
    dtype the array interface cannot name). Valid only while the owner lives."""
    if not arr.nbytes or np.dtype(arr.dtype.str) != arr.dtype:
        return None
    interface = {
        "data": (arr.__array_interface__["data"][0], False),
        "shape": arr.shape,
        "strides": arr.strides,
        "typestr": arr.dtype.str,
        "version": 3,
    }
    return np.asarray(_Memory(interface))


def match(
    tree: Any,
    spec: Any,
    values: list[Any],
    tensors: dict[str, Any] | None = None,
    token: Callable[[Any], Any] | None = None,
    keep_device: bool = False,
    views: dict[str, View] | None = None,
) -> list[tuple[str, Any]] | None:
    """The ``(key, array)`` pairs :func:`~.spec.flatten` gives for ``tree`` if
    ``tree`` has exactly the structure ``spec`` (flatten's spec of an earlier tree)
    describes, else None. JSON leaves are appended to ``values`` (the caller checks
    they are the spec's); ``tensors``, ``token`` and ``keep_device`` as in flatten.

    ``views``: with a ``token``, the numpy view of each torch tensor by key, kept from
    save to save (asking torch for one again was a third of planning a LoRA's ~900
    tensors). A view is taken again only when the tensor's token says its memory is
    not where it was: another storage (a weak reference's identity: a storage that
    died never matches; the storage fixes the device), another address, offset,
    shape, strides, dtype or lazy conjugate/negative bit. Only a view of the tensor's
    own memory is kept (never of a copy ``to_array`` made); it holds no reference to
    the tensor, so it never keeps memory alive, and it is used only while the tree
    being saved holds that storage."""
    m = _Match(values, tensors, token, keep_device, views)
    return m.arrays if type(spec) is dict and m.walk(tree, spec) else None


class _Match:
    """One match: the arrays found so far, and the walk over tree and spec together."""

    __slots__ = (
        "arrays",
        "jax_array",
        "keep_device",
        "tensor_type",
        "tensors",
        "to_array",
        "token",
        "values",
        "views",
    )

    def __init__(
        self,
        values: list[Any],
        tensors: dict[str, Any] | None,
        token: Callable[[Any], Any] | None,
        keep_device: bool,
        views: dict[str, View] | None,
    ) -> None:
        self.arrays: list[tuple[str, Any]] = []
        self.values, self.tensors, self.token = values, tensors, token
        self.keep_device, self.views = keep_device, views
        self.tensor_type = torch_tensor_type()
        self.to_array: Callable[[Any, bool], tuple[Any, str]] | None = None
        if self.tensor_type is not None:
            from ..leaves.torch_tensors import to_array

            self.to_array = to_array
        self.jax_array = getattr(sys.modules.get("jax"), "Array", None)

    def walk(self, node: Any, s: Any) -> bool:
        """Whether ``node`` has the structure of ``s`` (its leaves taken as it goes)."""
        t = type(node)
        if t is dict:
            items = s.get("dict")
            if items is None or len(s) != 1 or len(items) != len(node):
                return False
            walk = self.walk
            for (k, v), (k0, s0) in zip(node.items(), items, strict=True):
                if k is not k0 and (type(k) is not type(k0) or k != k0):
                    return False
                if type(k) is not str and type(k) is not int:
                    return False  # a subclass: its str(), which names the shard, may differ
                if not walk(v, s0):
                    return False
            return True
        if t is list or t is tuple:
            subs = s.get("tuple" if t is tuple else "list")
            if subs is None or len(s) != 1 or len(subs) != len(node):
                return False
            return all(self.walk(v, s0) for v, s0 in zip(node, subs, strict=True))
        return self.leaf(node, s)

    def leaf(self, v: Any, s: dict[str, Any]) -> bool:
        """Whether leaf ``v`` is of the kind spec leaf ``s`` says (taken if so)."""
        key = s.get("array")
        if key is not None:
            if "torch" in s:
                return self.tensor(v, s, key)
            if len(s) == 1 and type(v) is np.ndarray and not v.dtype.hasobject:
                self.arrays.append((key, v))
                return True
            if len(s) == 2 and s.get("scalar") and isinstance(v, np.generic):
                arr = np.asarray(v)  # (a numpy scalar: flatten saves it as a 0-d array)
                if not arr.dtype.hasobject:
                    self.arrays.append((key, arr))
                    return True
            return False  # (an array-like flatten converts, or another kind of leaf)
        key = s.get("jax")
        if key is not None:
            return self.jax(v, s, key)
        if "value" in s and len(s) == 1 and (v is None or type(v) in (bool, int, float, str)):
            if type(v) is int and abs(v) >= 2**63:
                return False  # a bigint: flatten writes it as text
            self.values.append(v)
            return True
        return False

    def tensor(self, v: Any, s: dict[str, Any], key: str) -> bool:
        """A torch tensor leaf: its view kept from the last save while its memory is
        where it was (:func:`match`'s ``views``), else taken anew."""
        if self.tensor_type is None or not isinstance(v, self.tensor_type) or len(s) != 2:
            return False
        assert self.to_array is not None
        tok = None if self.token is None else self.token(v)
        if self.tensors is not None:
            self.tensors[key] = tok
        views = self.views
        if tok is not None and views is not None and not s["torch"]:
            hit = views.get(key)
            if hit is not None and hit[0] is tok[0] and hit[1] == tok[1][1]:
                self.arrays.append((key, hit[2]))
                return True
        try:
            arr, torch_dtype = self.to_array(v, self.keep_device)
        except InvalidArgument:
            return False  # flatten says where, and why
        if torch_dtype != s["torch"]:
            return False
        self.arrays.append((key, arr))
        if (
            tok is not None
            and views is not None
            and type(arr) is np.ndarray
            and arr.__array_interface__["data"][0] == tok[1][1][0]
        ):
            # A view of the tensor's own memory only, never of a copy to_array made (a
            # lazily negated or conjugated tensor, another device's): that copy is
            # freed after this save.
            view = unowned(arr)
            if view is not None:
                views[key] = (tok[0], tok[1][1], view)
        return True

    def jax(self, v: Any, s: dict[str, Any], key: str) -> bool:
        """A jax array leaf of the spec's dtype (a typed PRNG key array never matches:
        flatten saves its key data)."""
        if self.jax_array is None or len(s) != 2 or not isinstance(v, self.jax_array):
            return False  # (a typed PRNG key array has key_impl too)
        dtype = v.dtype
        if not isinstance(dtype, np.dtype):
            return False
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            name = _DTYPE_NAMES[dtype] = dtype_to_str(dtype)
        if name != s["dtype"]:
            return False
        self.arrays.append((key, v))
        return True


__all__ = ["match"]
