"""What a save's structure decides (layout, shard table, tree spec text), kept while it
repeats: a training loop saves the same tree shape every time, and for a
transformer's thousands of arrays planning it again cost more than a tenth of
``save()`` (bench_transformer).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any

import numpy as np

from ckptd.core import shard_wire
from ckptd.core.format import TensorEntry, dtype_to_str, plan_layout

from .changes import Token, tensor_token, token_of
from .leaves.device import DeviceTensor
from .leaves.jax_arrays import Replicas, ShardPlan, is_jax_array, leaf_shards, single_shard
from .tree.match import View, match
from .tree.spec import flatten

Layout = list[tuple[str, np.dtype, tuple[int, ...]]]
Placed = dict[str, tuple[tuple[int, ...], list[tuple[int, int]]]]
Sharded = tuple[str, tuple[int, ...], list[tuple[int, int]]]
"""A shard's key, shape and index (a :class:`ShardPlan` without its data)."""


@dataclass(frozen=True)
class SavePlan:
    """A save's layout in its lease and what the commit sends about it."""

    layout: Layout
    """``(key, dtype, shape)`` of every shard, in tree order: the plan's identity."""
    placed: Placed
    """Shards of larger (jax) arrays: their global shape and index."""
    entries: list[TensorEntry]
    """Where each shard goes in the lease."""
    host_entries: list[TensorEntry]
    """The entries of host arrays (copied before save() returns)."""
    device_entries: list[TensorEntry]
    """The entries of jax array shards (copied in the background)."""
    table: Any
    """``entries`` as the commit's ``pb.ShardTable``."""
    data_len: int
    spec: Any
    values_json: str
    """The spec's JSON leaves alone as JSON: ``spec ==`` takes 1 for 1.0 and True."""
    tree_json: str

    @cached_property
    def keys(self) -> list[str]:
        """The key of each entry, in lease order."""
        return [e.key for e in self.entries]


@dataclass(frozen=True)
class Arrays:
    """A flattened tree's array leaves, split by where their bytes are."""

    host: dict[str, Any]
    """numpy arrays (and anything else ``np.asarray`` took), copied before save() returns."""
    device: dict[str, ShardPlan]
    """jax array shards, copied device-to-host in the background."""
    tokens: dict[str, Token | None] | None = None
    """Each shard's change token (changes.py), when asked for."""
    cuda: dict[str, DeviceTensor] | None = None
    """The CUDA tensors among ``host`` (copied from the device straight into the lease)."""


_Placing = tuple[
    dict[str, Any], dict[str, ShardPlan], Layout, Placed, dict[str, DeviceTensor] | None
]
"""What :meth:`Planner._place` finds: host arrays, jax shards, layout, placement, CUDA
tensors."""


class Planner:
    """Plans saves; reuses the last plan while the tree's structure is the same."""

    def __init__(self, save_replicas: Replicas = False) -> None:
        self.save_replicas = save_replicas
        self._last: SavePlan | None = None
        # The shards of each jax array planned, while it lives: jax arrays are
        # immutable, and asking one for its shards again cost ~15 us (most of planning
        # a thousand-array save whose frozen weights are the same objects each time).
        self._shards: dict[int, tuple[weakref.ref[Any], str, list[Sharded]]] = {}
        self._views: dict[str, View] = {}
        """Torch tensors' numpy views by key, while their memory stays (tree/match.py)."""

    @property
    def last(self) -> SavePlan | None:
        """The plan of the last save planned (the next one's likely layout)."""
        return self._last

    def plan(
        self,
        tree: Any,
        track: bool = False,
        torch_versions: bool = False,
        trust_jax: bool = False,
    ) -> tuple[SavePlan, Arrays]:
        """The plan of saving ``tree``, and its arrays (``track``: with their tokens:
        torch tensors' only with ``torch_versions``, jax arrays' where their memory is
        jax's alone or with ``trust_jax``; changes.py)."""
        tokens: dict[str, Token | None] | None = {} if track else None
        spec, arrays, values_json = self._leaves(tree, tokens, torch_versions)
        placing = self._place(arrays, tokens, trust_jax)
        plan = self._laid_out(placing, spec, values_json)
        self._last = plan
        host, device, _, _, cuda = placing
        return plan, Arrays(host, device, tokens, cuda)

    def _leaves(
        self, tree: Any, tokens: dict[str, Token | None] | None, torch_versions: bool
    ) -> tuple[Any, list[tuple[str, Any]], str]:
        """``tree``'s spec, its ``(key, array)`` leaves and its JSON values: the last
        save's spec again when the structure is the same (a training loop's every save:
        the tree is matched against it, not flattened anew; tree/match.py)."""
        values: list[Any] = []
        token = tensor_token if torch_versions else None
        last = self._last
        views = self._views if torch_versions else None
        found = None
        if last is not None:
            found = match(tree, last.spec, values, tokens, token, True, views)
        if last is not None and found is not None and _json(values) == last.values_json:
            return last.spec, found, last.values_json
        values.clear()
        self._views.clear()  # (of keys the new structure may not have)
        if tokens is not None:
            tokens.clear()
        spec, arrays = flatten(tree, values, tokens, token, keep_device=True)
        return spec, arrays, _json(values)

    def _place(
        self,
        arrays: list[tuple[str, Any]],
        tokens: dict[str, Token | None] | None,
        trust_jax: bool,
    ) -> _Placing:
        """Each leaf by where its bytes are (host, a jax array's shards, a CUDA
        tensor), and the layout and placement of every shard, in leaf order."""
        host: dict[str, Any] = {}
        device: dict[str, ShardPlan] = {}
        layout: Layout = []
        placed: Placed = {}
        cuda: dict[str, DeviceTensor] | None = None
        for key, a in arrays:
            if type(a) is not np.ndarray and is_jax_array(a):
                for sp in self._leaf_shards(key, a):
                    device[sp.key] = sp
                    layout.append((sp.key, np.dtype(a.dtype), sp.shape))
                    placed[sp.key] = (tuple(a.shape), sp.index)
                    if tokens is not None:
                        tokens[sp.key] = token_of(a, tuple(sp.index), trust_jax)
            else:
                host[key] = a
                layout.append((key, a.dtype, a.shape))
                if type(a) is DeviceTensor:
                    cuda = cuda or {}
                    cuda[key] = a
        return host, device, layout, placed, cuda

    def _laid_out(self, placing: _Placing, spec: Any, values_json: str) -> SavePlan:
        """The plan: the last one's entries and wire table again when the layout is the
        same (the usual case), else laid out anew."""
        _, device, layout, placed, _ = placing
        last = self._last
        if last is not None and last.layout == layout and last.placed == placed:
            same = last.spec is spec or (last.values_json == values_json and last.spec == spec)
            return SavePlan(
                layout,
                placed,
                last.entries,
                last.host_entries,
                last.device_entries,
                last.table,
                last.data_len,
                spec,
                values_json,
                last.tree_json if same else _json(spec),
            )
        entries = plan_layout(layout)
        dtypes = {k: dtype_to_str(dt) for k, dt, _ in layout}
        table = shard_wire.encode(entries, dtypes, placed)
        return SavePlan(
            layout,
            placed,
            entries,
            [e for e in entries if e.key not in device],
            [e for e in entries if e.key in device],
            table,
            sum(e.length for e in entries),
            spec,
            values_json,
            _json(spec),
        )

    def _leaf_shards(self, key: str, a: Any) -> list[ShardPlan]:
        """``leaf_shards(key, a)``, asked of ``a`` once while it lives if its shards
        are ``a`` itself (the cache holds no reference to it). A single-device array's
        one shard is itself, told without asking jax (and without the cache)."""
        one = single_shard(key, a)
        if one is not None:
            return [one]
        hit = self._shards.get(id(a))
        if hit is not None and hit[0]() is a and hit[1] == key:
            return [ShardPlan(k, a, shape, index) for k, shape, index in hit[2]]
        shards = leaf_shards(key, a, self.save_replicas)
        if all(sp.data is a for sp in shards):
            try:
                ref = weakref.ref(a, partial(_forget, self._shards, id(a)))
            except TypeError:
                return shards
            self._shards[id(a)] = (ref, key, [(sp.key, sp.shape, sp.index) for sp in shards])
        return shards


def _forget(shards: dict[int, Any], ident: int, ref: weakref.ref[Any]) -> None:
    """Drop the entry of an array that died (unless another took its id since)."""
    hit = shards.get(ident)
    if hit is not None and hit[0] is ref:
        shards.pop(ident, None)


def _json(spec: Any) -> str:
    try:
        return json.dumps(spec, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the tree holds a value JSON cannot store: {exc}") from None


def plan_in_place(tree: Any, mm: Any) -> SavePlan | None:
    """The plan of saving ``tree`` whose array leaves are already in ``mm`` (a lease's
    mapping, filled by a stager): each where it lies, not where a fresh layout would
    put it. None unless they lie back to back from the start of ``mm`` (no hole, no
    overlap, each C-contiguous and aligned), which a commit needs."""
    values: list[Any] = []
    spec, arrays = flatten(tree, values)
    view = np.frombuffer(mm, np.uint8)
    base, size = view.__array_interface__["data"][0], len(view)
    del view  # (an export of the mapping: it must not outlive this call)
    placed = []
    for key, a in arrays:
        if not isinstance(a, np.ndarray) or not (a.flags.c_contiguous or a.nbytes == 0):
            return None
        offset = a.__array_interface__["data"][0] - base if a.nbytes else -1
        if a.nbytes and (offset < 0 or offset + a.nbytes > size or offset % a.dtype.alignment):
            return None
        placed.append((offset, key, a))
    entries: list[TensorEntry] = []
    at = 0
    for offset, key, a in sorted(placed, key=lambda p: (p[0] < 0, p[0])):
        if a.nbytes and offset != at:
            return None  # a hole or an overlap
        entries.append(TensorEntry(key, a.dtype, tuple(a.shape), at, a.nbytes))
        at += a.nbytes
    layout: Layout = [(e.key, e.dtype, e.shape) for e in entries]
    dtypes = {e.key: dtype_to_str(e.dtype) for e in entries}
    return SavePlan(
        layout,
        {},
        entries,
        [],
        [],
        shard_wire.encode(entries, dtypes, {}),
        at,
        spec,
        _json(values),
        _json(spec),
    )
