"""Shards as columns: one list or array per field, one entry per shard.

A transformer with its optimizer state is thousands of tensors per rank. Held as
one object per shard, every commit, manifest and restore paid microseconds of
Python per tensor (building records, checking them, a JSON object each). As
columns, the checks are a few numpy operations, the manifest's JSON is a handful
of flat lists, and the per-shard work left is what a file format needs (the
safetensors header names every tensor) or what a reader asks for (``records``).

The same table travels on the wire (``pb.ShardTable``, see ``encode``/``decode``),
sits in a validated commit and in a manifest, and is written to ``manifest.json``
(format version 2, ``columns_json``/``from_plain``).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import InvalidArgument
from .format import TensorEntry, str_to_dtype
from .names import MAX_SHARD_KEY_BYTES, check_shard_key

Ints = npt.NDArray[np.int64]

MAX_NDIM = 64
MAX_DIM = 2**62
"""No dimension, offset or length reaches this (MAX_FILE_BYTES)."""
_BAD_KEY = re.compile(r"[\x00-\x09\x0b-\x1f\x7f/\\]|\.\.")
"""Anything :func:`check_shard_key` refuses, but the newline that joins keys here."""


@dataclass(frozen=True, eq=False)
class ShardTable:
    """Shards as columns. ``shape``, ``global_shape`` and ``start`` are flat:
    ``ndim[i]`` values per shard, in shard order. ``offset`` is from the start of
    the lease's data (a commit) or of the rank file (a manifest)."""

    keys: list[str]
    dtypes: list[str]
    ndim: Ints
    shape: Ints
    global_shape: Ints
    start: Ints
    offset: Ints
    length: Ints
    rank: Ints = field(default_factory=lambda: np.zeros(0, np.int64))
    crc32c: Ints = field(default_factory=lambda: np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.keys)

    @cached_property
    def _bounds(self) -> list[int]:
        """Where each shard's dimensions begin in the flat columns (and the end)."""
        return [0, *np.cumsum(self.ndim).tolist()]

    def dims(self, flat: Ints) -> list[list[int]]:
        """A flat column (``shape``, ``global_shape``, ``start``) as one list per shard."""
        values, b = flat.tolist(), self._bounds
        return [values[b[i] : b[i + 1]] for i in range(len(self.keys))]

    def entries(self) -> list[TensorEntry]:
        """The shards as layout entries (a reader's view; commits use the columns)."""
        dts = {name: str_to_dtype(name) for name in set(self.dtypes)}
        return [
            TensorEntry(k, dts[d], tuple(s), o, n)
            for k, d, s, o, n in zip(
                self.keys,
                self.dtypes,
                self.dims(self.shape),
                self.offset.tolist(),
                self.length.tolist(),
                strict=True,
            )
        ]

    def placed(self, rank: int, offset: int, crcs: Sequence[int]) -> ShardTable:
        """This commit's table as a manifest holds it: in rank ``rank``'s file, whose
        data starts ``offset`` bytes in, with each shard's crc32c."""
        n = len(self.keys)
        return ShardTable(
            self.keys,
            self.dtypes,
            self.ndim,
            self.shape,
            self.global_shape,
            self.start,
            self.offset + offset,
            self.length,
            np.full(n, rank, np.int64),
            np.asarray(crcs, np.int64).reshape(n),
        )

    def select(self, rows: Ints) -> ShardTable:
        """The shards at positions ``rows``, in that order."""
        lo = np.asarray(self._bounds[:-1], np.int64)[rows]
        flat = np.repeat(lo, self.ndim[rows]) + _ramp(self.ndim[rows])
        return ShardTable(
            [self.keys[i] for i in rows.tolist()],
            [self.dtypes[i] for i in rows.tolist()],
            self.ndim[rows],
            self.shape[flat],
            self.global_shape[flat],
            self.start[flat],
            self.offset[rows],
            self.length[rows],
            self.rank[rows],
            self.crc32c[rows],
        )

    def of_rank(self, rank: int) -> ShardTable:
        """The shards of one rank (a manifest's table)."""
        return self.select(np.flatnonzero(self.rank == rank))

    def rows(self, files: dict[int, str]) -> list[tuple[Any, ...]]:
        """Each shard as a tuple of the fields of :data:`ROW_FIELDS` (format version 1's
        record), ``files`` naming each rank's file."""
        return [
            (k, r, d, s, g, [[a, a + n] for a, n in zip(i, s, strict=True)], files[r], o, n, c)
            for k, r, d, s, g, i, o, n, c in zip(
                self.keys,
                self.rank.tolist(),
                self.dtypes,
                self.dims(self.shape),
                self.dims(self.global_shape),
                self.dims(self.start),
                self.offset.tolist(),
                self.length.tolist(),
                self.crc32c.tolist(),
                strict=True,
            )
        ]

    @staticmethod
    def concat(tables: Sequence[ShardTable]) -> ShardTable:
        """One table holding every shard of ``tables``, in order."""
        if len(tables) == 1:
            return tables[0]

        def cat(name: str) -> Ints:
            parts = [getattr(t, name) for t in tables]
            return np.concatenate(parts) if parts else np.zeros(0, np.int64)

        return ShardTable(
            [k for t in tables for k in t.keys],
            [d for t in tables for d in t.dtypes],
            *(cat(name) for name in _INT_COLUMNS),
        )

    def columns_json(self) -> dict[str, str]:
        """The columns as ``manifest.json`` (version 2) stores the shards, each as
        compact JSON text. Every save of an unchanged structure writes the same
        columns but crc32c, so their text is kept by content (~60 ns a value to
        write, a hash of its bytes to find again)."""
        out = {"key": _cached_json(self.keys), "dtype": _cached_json(self.dtypes)}
        for name in _INT_COLUMNS:
            col = getattr(self, name)
            out[name] = _json(col.tolist()) if name == "crc32c" else _cached_json(col)
        return out

    @staticmethod
    def from_plain(raw: Any) -> ShardTable:
        """Parse the shards of ``manifest.json`` (:meth:`columns_json`'s columns, as
        JSON values); raises InvalidArgument naming the bad column."""
        if not isinstance(raw, dict) or set(raw) != {"key", "dtype", *_INT_COLUMNS}:
            raise InvalidArgument(
                f"shards must hold the columns {sorted(['key', 'dtype', *_INT_COLUMNS])}"
            )
        keys, dtypes = raw["key"], raw["dtype"]
        for name, col in (("key", keys), ("dtype", dtypes)):
            if not isinstance(col, list) or not all(type(v) is str for v in col):
                raise InvalidArgument(f"shards.{name} must be a list of strings")
        ints = [_int_column(f"shards.{name}", raw[name]) for name in _INT_COLUMNS]
        return ShardTable(keys, dtypes, *ints)

    def check(self, *, placed: bool) -> None:
        """Every column has its length; every key, dtype, shape and index is valid.

        ``placed``: a manifest's table, whose ``rank`` and ``crc32c`` columns are set.
        Raises InvalidArgument naming the first bad shard."""
        n = len(self.keys)
        sizes = {"dtype": len(self.dtypes), "ndim": len(self.ndim)}
        sizes |= {"offset": len(self.offset), "length": len(self.length)}
        if placed:
            sizes |= {"rank": len(self.rank), "crc32c": len(self.crc32c)}
        for name, size in sizes.items():
            if size != n:
                raise InvalidArgument(f"{n} shard keys but {size} values of {name}")
        if n and (self.ndim.min() < 0 or self.ndim.max() > MAX_NDIM):
            raise InvalidArgument(f"a shard has more than {MAX_NDIM} dimensions")
        total = int(self.ndim.sum())
        for name in ("shape", "global_shape", "start"):
            if len(getattr(self, name)) != total:
                raise InvalidArgument(
                    f"{name} holds {len(getattr(self, name))} values, not {total}"
                )
        # A rank's keys are unique (a commit); a manifest may repeat one across ranks.
        _check_keys(self.keys, unique=not placed)
        for name in ("shape", "global_shape", "start", "offset", "length"):
            col = getattr(self, name)
            bad = np.flatnonzero((col < 0) | (col >= MAX_DIM))
            if len(bad):
                i = int(bad[0]) if name in ("offset", "length") else self._shard_at(int(bad[0]))
                raise InvalidArgument(
                    f"shard {self.keys[i]!r}: {name} has a value outside [0, 2**62); no array "
                    "that large can be stored"
                )
        if placed and n and (self.crc32c.min() < 0 or self.crc32c.max() >= 2**32):
            raise InvalidArgument("a shard's crc32c is not a 32-bit value")
        wrong = self.start + self.shape > self.global_shape
        if wrong.any():
            i = self._shard_at(int(np.argmax(wrong)))
            raise InvalidArgument(
                f"shard {self.keys[i]!r}: its index does not place shape "
                f"{self.dims(self.shape)[i]} inside global shape {self.dims(self.global_shape)[i]}"
            )
        if placed:
            # A dtype this reader does not know (an older ml_dtypes) must not make a
            # good copy look corrupt: its bytes are checked by crc, not by dtype.
            return
        want = self._nbytes()
        bad = np.flatnonzero(want != self.length)
        if len(bad):
            i = int(bad[0])
            raise InvalidArgument(
                f"shard {self.keys[i]!r}: length {int(self.length[i])} != {int(want[i])} bytes "
                f"for shape {self.dims(self.shape)[i]} of {self.dtypes[i]}"
            )

    def _shard_at(self, pos: int) -> int:
        """The shard whose dimensions hold position ``pos`` of a flat column."""
        return int(np.searchsorted(np.cumsum(self.ndim), pos, side="right"))

    def _nbytes(self) -> Ints:
        """Bytes of each shard from its dtype and shape (float products first: a
        product past 2**62 is refused before it could wrap an integer)."""
        itemsize = {}
        for name in set(self.dtypes):
            try:
                itemsize[name] = str_to_dtype(name).itemsize
            except ValueError as exc:
                raise InvalidArgument(
                    f"{exc}; use a numpy dtype string (np.dtype(x).str, e.g. '<f4') or an "
                    "ml_dtypes name such as 'bfloat16'"
                ) from None
        sizes = np.fromiter((itemsize[d] for d in self.dtypes), np.int64, len(self.dtypes))
        rows = np.repeat(np.arange(len(self.keys)), self.ndim)
        approx = np.ones(len(self.keys))
        np.multiply.at(approx, rows, self.shape.astype(np.float64))
        if len(approx) and (approx * sizes).max() >= MAX_DIM:
            i = int(np.argmax(approx * sizes))
            raise InvalidArgument(
                f"shard {self.keys[i]!r}: shape {self.dims(self.shape)[i]} is too large to store"
            )
        exact = np.ones(len(self.keys), np.int64)
        np.multiply.at(exact, rows, self.shape)
        return exact * sizes

    def check_layout(self) -> int:
        """The shards are packed back to back from offset 0, each aligned to its dtype;
        returns the data section's size. Raises InvalidArgument naming the bad shard.
        Checked once per table (a training loop's commits share the one the daemon's
        parser checked first: every step's layout, ~0.2 ms for a thousand shards)."""
        return self._layout_size

    @cached_property
    def _layout_size(self) -> int:
        # (A table that fails raises here each time: cached_property keeps no error.)
        n = len(self.keys)
        if not n:
            return 0
        order = np.lexsort((self.length, self.offset))
        off, end = self.offset[order], (self.offset + self.length)[order]
        gaps = np.flatnonzero(off != np.concatenate(([0], end[:-1])))
        if len(gaps):
            i, at = int(order[gaps[0]]), int(gaps[0])
            prev = int(end[at - 1]) if at else 0
            raise InvalidArgument(
                f"shard {self.keys[i]!r} starts at {int(self.offset[i])} but the previous shard "
                f"ends at {prev}: shards must be packed back to back with no holes or overlaps"
            )
        align = {name: str_to_dtype(name).alignment for name in set(self.dtypes)}
        alignment = np.fromiter((align[d] for d in self.dtypes), np.int64, n)
        bad = np.flatnonzero((self.offset % alignment != 0) & (self.length > 0))
        if len(bad):
            i = int(bad[0])
            raise InvalidArgument(
                f"shard {self.keys[i]!r} at offset {int(self.offset[i])} is not aligned to "
                "its dtype"
            )
        return int(end[-1])


ROW_FIELDS = (
    "key",
    "rank",
    "dtype",
    "shape",
    "global_shape",
    "index",
    "file",
    "offset",
    "length",
    "crc32c",
)
"""A shard's fields one record each (format version 1; ShardRecord's order)."""

_INT_COLUMNS = (
    "ndim",
    "shape",
    "global_shape",
    "start",
    "offset",
    "length",
    "rank",
    "crc32c",
)


def _ramp(counts: Ints) -> Ints:
    """0, 1, ..., c-1 for each count c, concatenated."""
    total = int(counts.sum())
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total, dtype=np.int64) - starts


_COLUMN_TEXT: OrderedDict[tuple[str, bytes | tuple[str, ...]], str] = OrderedDict()
_COLUMN_TEXT_KEEP = 64
_COLUMN_CACHE_MAX = 200_000
_column_lock = threading.Lock()


def _json(values: list[Any]) -> str:
    return json.dumps(values, separators=(",", ":"))


def _cached_json(col: Ints | list[str]) -> str:
    """``col`` as JSON text, from the cache when a column of equal content was written
    before (keyed by its bytes, or its strings)."""
    if len(col) > _COLUMN_CACHE_MAX:  # a rare giant: not worth its memory in the cache
        return _json(col.tolist() if isinstance(col, np.ndarray) else col)
    key = (col.dtype.str, col.tobytes()) if isinstance(col, np.ndarray) else ("s", tuple(col))
    with _column_lock:
        text = _COLUMN_TEXT.get(key)
        if text is not None:
            _COLUMN_TEXT.move_to_end(key)
            return text
    text = _json(col.tolist() if isinstance(col, np.ndarray) else col)
    with _column_lock:
        _COLUMN_TEXT[key] = text
        while len(_COLUMN_TEXT) > _COLUMN_TEXT_KEEP:
            _COLUMN_TEXT.popitem(last=False)
    return text


def _int_column(name: str, values: Any) -> Ints:
    if not isinstance(values, list) or not all(type(v) is int for v in values):
        raise InvalidArgument(f"{name} must be a list of integers")
    if values and (min(values) < -(2**63) or max(values) >= 2**63):
        raise InvalidArgument(f"{name} holds a value outside 64 bits")
    return np.array(values, np.int64)


def _check_keys(keys: list[str], unique: bool) -> None:
    """Each key passes :func:`check_shard_key` (and appears once if ``unique``): one
    regex over the joined keys, a set and a length scan; a key that fails is then
    named by the per-key check."""
    joined = "\n".join(keys)
    ok = (
        joined.count("\n") == max(len(keys) - 1, 0)
        and not _BAD_KEY.search(joined)
        and "" not in keys
        and "__metadata__" not in keys
    )
    if ok and keys and max(map(len, keys)) * 4 > MAX_SHARD_KEY_BYTES:
        ok = all(len(k.encode("utf-8", "surrogatepass")) <= MAX_SHARD_KEY_BYTES for k in keys)
    if not ok:
        for key in keys:
            check_shard_key(key)
    if unique and len(set(keys)) != len(keys):
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise InvalidArgument(
            f"duplicate shard key {dup!r}; every shard of a rank needs its own key"
        )


def empty_table() -> ShardTable:
    """A table of no shards (an adopted tree's manifest)."""
    none = np.zeros(0, np.int64)
    return ShardTable([], [], none, none, none, none, none, none, none, none)


def table_of(manifest: dict[str, Any]) -> ShardTable:
    """A parsed ``manifest.json``'s shards as columns, whichever version it is (a
    client restoring a rank; the daemon checked the manifest before handing it over)."""
    shards = manifest["shards"]
    if not isinstance(shards, list):
        return ShardTable.from_plain(shards)
    return ShardTable.from_plain(
        {
            "key": [s["key"] for s in shards],
            "dtype": [s["dtype"] for s in shards],
            "ndim": [len(s["shape"]) for s in shards],
            "shape": [d for s in shards for d in s["shape"]],
            "global_shape": [d for s in shards for d in s["global_shape"]],
            "start": [p[0] for s in shards for p in s["index"]],
            "offset": [s["offset"] for s in shards],
            "length": [s["length"] for s in shards],
            "rank": [s["rank"] for s in shards],
            "crc32c": [s["crc32c"] for s in shards],
        }
    )


def rows(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """A parsed ``manifest.json``'s shards one dict each (the fields of format version
    1: key, rank, dtype, shape, global_shape, index, file, offset, length, crc32c),
    whichever version it is: what a client restoring a rank reads shard by shard."""
    shards = manifest["shards"]
    if isinstance(shards, list):
        return shards
    files = {r["rank"]: r["file"] for r in manifest["ranks"]}
    return [
        dict(zip(ROW_FIELDS, row, strict=True)) for row in ShardTable.from_plain(shards).rows(files)
    ]
