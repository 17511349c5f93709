"""What a save's structure decides (layout, shard table, tree spec text), kept while it
repeats: a training loop saves the same tree shape every time, and for a
transformer's thousands of arrays planning it again cost more than a tenth of
``save()`` (bench_transformer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptd.core import shard_wire
from ckptd.core.format import TensorEntry, dtype_to_str, plan_layout

from .jax_arrays import ShardPlan, is_jax_array, leaf_shards
from .tree import flatten

Layout = list[tuple[str, np.dtype, tuple[int, ...]]]
Placed = dict[str, tuple[tuple[int, ...], list[tuple[int, int]]]]


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


@dataclass(frozen=True)
class Arrays:
    """A flattened tree's array leaves, split by where their bytes are."""

    host: dict[str, Any]
    """numpy arrays (and anything else ``np.asarray`` took), copied before save() returns."""
    device: dict[str, ShardPlan]
    """jax array shards, copied device-to-host in the background."""


class Planner:
    """Plans saves; reuses the last plan while the tree's structure is the same."""

    def __init__(self, save_replicas: bool = False) -> None:
        self.save_replicas = save_replicas
        self._last: SavePlan | None = None
        self.reused = 0
        """Saves planned from the last plan (for tests and benchmarks)."""

    def plan(self, tree: Any) -> tuple[SavePlan, Arrays]:
        """The plan of saving ``tree``, and its arrays."""
        values: list[Any] = []
        spec, arrays = flatten(tree, values)
        values_json = _json(values)
        host: dict[str, Any] = {}
        device: dict[str, ShardPlan] = {}
        layout: Layout = []
        placed: Placed = {}
        for key, a in arrays:
            if type(a) is not np.ndarray and is_jax_array(a):
                for sp in leaf_shards(key, a, self.save_replicas):
                    device[sp.key] = sp
                    layout.append((sp.key, np.dtype(a.dtype), sp.shape))
                    placed[sp.key] = (tuple(a.shape), sp.index)
            else:
                host[key] = a
                layout.append((key, a.dtype, a.shape))
        last = self._last
        if last is not None and last.layout == layout and last.placed == placed:
            same = last.values_json == values_json and last.spec == spec
            plan = SavePlan(
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
            self.reused += 1
        else:
            entries = plan_layout(layout)
            dtypes = {k: dtype_to_str(dt) for k, dt, _ in layout}
            table = shard_wire.encode(entries, dtypes, placed)
            data_len = sum(e.length for e in entries)
            plan = SavePlan(
                layout,
                placed,
                entries,
                [e for e in entries if e.key not in device],
                [e for e in entries if e.key in device],
                table,
                data_len,
                spec,
                values_json,
                _json(spec),
            )
        self._last = plan
        return plan, Arrays(host, device)


def _json(spec: Any) -> str:
    try:
        return json.dumps(spec, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the tree holds a value JSON cannot store: {exc}") from None
