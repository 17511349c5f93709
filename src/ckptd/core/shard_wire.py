"""A commit's shards on the wire (``pb.ShardTable``): what the client sends and the
daemon checks into a :class:`ShardTable`.

Integers travel as packed little-endian bytes, so thousands of shards are read
with ``np.frombuffer`` rather than a message each; values of 2**62 or more are
refused before the cast to int64 could wrap them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import InvalidArgument
from .format import TensorEntry
from .shard_table import MAX_DIM, MAX_NDIM, Ints, ShardTable


def encode(entries: Sequence[TensorEntry], dtypes: dict[str, str], placed: dict[str, Any]) -> Any:
    """A client's layout as a ``pb.ShardTable``: ``dtypes`` names each key's dtype,
    ``placed`` maps the keys of shards of larger arrays to (global shape, index)."""
    from ckptd.proto import ckptd_pb2 as pb  # core stays importable without the stubs

    names: dict[str, int] = {}
    index = [names.setdefault(dtypes[e.key], len(names)) for e in entries]
    shape = [d for e in entries for d in e.shape]
    table = pb.ShardTable(
        keys=[e.key for e in entries],
        dtype_names=list(names),
        dtype_index=np.array(index, "<u2").tobytes(),
        ndim=np.fromiter((len(e.shape) for e in entries), np.uint8, len(entries)).tobytes(),
        shape=np.array(shape, "<u8").tobytes(),
        offset=np.fromiter((e.offset for e in entries), "<u8", len(entries)).tobytes(),
        length=np.fromiter((e.length for e in entries), "<u8", len(entries)).tobytes(),
    )
    if placed:
        gshape: list[int] = []
        start: list[int] = []
        for e in entries:
            whole, where = placed.get(e.key, (e.shape, [(0, d) for d in e.shape]))
            gshape.extend(whole)
            start.extend(a for a, _ in where)
        table.global_shape = np.array(gshape, "<u8").tobytes()
        table.start = np.array(start, "<u8").tobytes()
    return table


def decode(table: Any) -> ShardTable:
    """A ``pb.ShardTable`` as columns, checked (:meth:`ShardTable.check`) and with a
    packed layout (:meth:`ShardTable.check_layout` is left to the caller)."""
    n = len(table.keys)
    names = list(table.dtype_names)
    ndim = _wire_column("ndim", table.ndim, "u1", n)
    if n and int(ndim.max()) > MAX_NDIM:
        raise InvalidArgument(f"a shard has more than {MAX_NDIM} dimensions")
    total = int(ndim.sum())
    shape = _wire_column("shape", table.shape, "<u8", total)
    gshape = _wire_column("global_shape", table.global_shape, "<u8", total, shape)
    start = _wire_column("start", table.start, "<u8", total, np.zeros(total, np.int64))
    which = _wire_column("dtype_index", table.dtype_index, "<u2", n)
    if n and int(which.max()) >= len(names):
        raise InvalidArgument(
            f"dtype_index {int(which.max())} is past the {len(names)} dtype names sent"
        )
    cols = ShardTable(
        list(table.keys),
        [names[i] for i in which.tolist()],
        ndim,
        shape,
        gshape,
        start,
        _wire_column("offset", table.offset, "<u8", n),
        _wire_column("length", table.length, "<u8", n),
    )
    cols.check(placed=False)
    return cols


def _wire_column(
    name: str, raw: bytes, dtype: str, count: int, default: Ints | None = None
) -> Ints:
    """``count`` little-endian integers of ``dtype`` from ``raw`` (``default`` when
    it is empty), as int64; values of 2**62 or more are refused before the cast."""
    if not raw and default is not None:
        return default
    size = np.dtype(dtype).itemsize
    if len(raw) != count * size:
        raise InvalidArgument(
            f"table.{name} holds {len(raw)} bytes; {count} values of {size} bytes were expected"
        )
    values = np.frombuffer(raw, dtype)
    if size == 8 and count and int(values.max()) >= MAX_DIM:
        raise InvalidArgument(
            f"table.{name} has a value of 2**62 or more; no array that large can be stored"
        )
    return values.astype(np.int64)
