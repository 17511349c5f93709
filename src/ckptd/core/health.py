"""Health tags: NaN and Inf counted in a checkpoint's floating shards as it is written.

A training run that diverges keeps saving: the newest steps then hold NaN or Inf
and restoring them restarts the divergence. The daemon counts the non-finite
elements of every floating shard on the same trailing pass that computes the
shard's crc32c (the chunk just written, still warm), and records:

- in the manifest, ``nonfinite``: per rank, the shards that hold any, with their
  counts (``{}`` for a rank whose shards are all finite);
- in the step's metrics, ``ckptd.nonfinite``: the total over this node's ranks,
  so the tag travels wherever metrics already do (the bucket's markers and index,
  ``ckptd ls``, retention) and older daemons read it as one more metric.

A step is *healthy* when that total is 0, *unhealthy* when it is more, and of
unknown health without it (saved by a ckptd before health tags, or an adopted
directory). ``restore(healthy=True)`` takes the newest healthy step, and every
tier keeps the newest healthy step ("last-known-good") while newer ones are not.

Counted dtypes: float16/32/64, complex64/128 (each part), bfloat16 and the 8-bit
floats that have NaN or Inf encodings. Integer, bool and the 4/6-bit floats
(which encode neither) are not counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from .format import str_to_dtype

NONFINITE_METRIC = "ckptd.nonfinite"
"""The step's metric holding its count of NaN/Inf elements (this node's ranks)."""
RESERVED_PREFIX = "ckptd."
"""Metric names the daemon sets; a save may not set them."""
_BLOCK = 2**20
"""Bytes per counting pass: the temporaries stay in cache and are reused."""


class _Test(NamedTuple):
    """How one dtype's non-finite elements are found."""

    view: np.dtype
    """The dtype the bytes are viewed as."""
    mask: int
    """0: ``np.isfinite`` on ``view``; else an element is non-finite when
    ``bits & mask == value``."""
    value: int


# Bit patterns (exponent all ones, or the one NaN code of the "fnuz" formats).
_BITS = {
    "float16": _Test(np.dtype("<u2"), 0x7C00, 0x7C00),
    "bfloat16": _Test(np.dtype("<u2"), 0x7F80, 0x7F80),
    "float8_e5m2": _Test(np.dtype("u1"), 0x7C, 0x7C),
    "float8_e4m3fn": _Test(np.dtype("u1"), 0x7F, 0x7F),
    "float8_e4m3fnuz": _Test(np.dtype("u1"), 0xFF, 0x80),
    "float8_e5m2fnuz": _Test(np.dtype("u1"), 0xFF, 0x80),
    "float8_e4m3b11fnuz": _Test(np.dtype("u1"), 0xFF, 0x80),
}


def _test(dtype_name: str) -> _Test | None:
    """How to count ``dtype_name``'s non-finite elements (None: not a counted dtype)."""
    try:
        dt = str_to_dtype(dtype_name)
    except ValueError:
        return None
    if dt.name in _BITS and (dt.byteorder != ">" or dt.itemsize == 1):
        return _BITS[dt.name]
    if dt.kind == "f" and dt.itemsize in (4, 8):
        return _Test(dt, 0, 0)
    if dt.kind == "c" and dt.itemsize in (8, 16):
        return _Test(np.empty(0, dt).real.dtype, 0, 0)  # each part, byte order kept
    return None


def counted(dtype_name: str) -> bool:
    """Whether shards of ``dtype_name`` are counted."""
    return _test(dtype_name) is not None


def _count(test: _Test, data: np.ndarray) -> int:
    """Non-finite elements in ``data`` (uint8, a whole number of elements)."""
    found = 0
    for at in range(0, len(data), _BLOCK):
        v = data[at : at + _BLOCK].view(test.view)
        if test.mask:
            found += int(np.count_nonzero((v & test.mask) == test.value))
        else:
            found += len(v) - int(np.count_nonzero(np.isfinite(v)))
    return found


def count_nonfinite(data: np.ndarray, dtype_name: str) -> int | None:
    """NaN/Inf elements of a shard held in ``data`` (its bytes, or an array of any
    dtype holding them); None: ``dtype_name`` is not counted."""
    test = _test(dtype_name)
    if test is None:
        return None
    return _count(test, np.ascontiguousarray(data).reshape(-1).view(np.uint8))


Plan = list[tuple[int, int, int, _Test]]
"""The counted shards in data order: offset, length, index, and how to count them."""


def plan(dtypes: Sequence[str], ranges: Sequence[tuple[int, int]]) -> Plan:
    """Which shards :class:`NonFiniteCount` reads, given each shard's dtype and
    ``(offset, length)`` in the data section (the same for every save of an
    unchanged structure, so callers may keep it)."""
    tests: dict[str, _Test | None] = {}
    todo = []
    for i, (dtype, (offset, length)) in enumerate(zip(dtypes, ranges, strict=True)):
        if dtype not in tests:
            tests[dtype] = _test(dtype)
        test = tests[dtype]
        if test is not None and length > 0:
            todo.append((offset, length, i, test))
    todo.sort(key=lambda t: t[0])
    return todo


class NonFiniteCount:
    """NaN/Inf per shard of a data section, fed in order as the data lands (like
    :class:`~ckptd.core.checksum.FileCrc`, on the same trailing chunks).

    ``keys``: each shard's name; ``todo``: :func:`plan` of their dtypes and ranges.
    """

    def __init__(self, keys: Sequence[str], todo: Plan) -> None:
        self._keys = keys
        self._todo = todo
        self._next = 0  # the shard being counted
        self._done = 0  # its bytes counted so far
        self._counts: dict[int, int] = {}

    def feed(self, data: np.ndarray, upto: int) -> None:
        """Count the data section's bytes up to ``upto`` (``data``: all of it, flat
        uint8). Calls come in order; one that reaches no further is a no-op."""
        todo = self._todo
        while self._next < len(todo):
            offset, length, i, test = todo[self._next]
            start = offset + self._done
            end = min(offset + length, upto)
            if end < offset + length:  # a chunk ends inside the shard: whole elements only
                end = start + max(end - start, 0) // test.view.itemsize * test.view.itemsize
            if end > start:
                found = _count(test, data[start:end])
                if found:
                    self._counts[i] = self._counts.get(i, 0) + found
                self._done = end - offset
            if self._done < length:
                return
            self._next += 1
            self._done = 0

    def result(self) -> dict[str, int]:
        """The shards holding any NaN/Inf, with their counts; raises if not all data
        was fed."""
        if self._next < len(self._todo):
            raise ValueError("not every floating shard was counted")
        return {str(self._keys[i]): n for i, n in sorted(self._counts.items())}


def healthy(metrics: Mapping[str, float] | None) -> bool | None:
    """A step's health from its metrics: True (no NaN/Inf), False, or None (unknown)."""
    if not metrics or NONFINITE_METRIC not in metrics:
        return None
    return metrics[NONFINITE_METRIC] == 0


__all__ = [
    "NONFINITE_METRIC",
    "RESERVED_PREFIX",
    "NonFiniteCount",
    "count_nonfinite",
    "counted",
    "healthy",
    "plan",
]
