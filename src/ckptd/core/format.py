"""Shard-file format shared by the client and the daemon.

A rank's shards are laid out in its shared-memory lease exactly as the data
section of its safetensors file: sorted by alignment (largest first) so every
tensor starts at a multiple of its alignment with no holes between tensors (the
safetensors library rejects holes). The daemon prepends a header padded with
spaces to a multiple of ``ALIGN`` bytes, so the data section starts on a page
boundary in the file too and can be written with large aligned ``O_DIRECT``
writes straight from the lease.

Dtypes that ``safetensors.numpy`` cannot load (bfloat16, float8, complex128,
strings, datetimes, big-endian data, ...) are stored as ``U8`` bytes; the true
dtype and shape live in ckptd's manifest and in the file's ``__metadata__``.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from json.encoder import encode_basestring_ascii as _json_string
from typing import NamedTuple

import numpy as np

ALIGN = 4096
"""Page alignment of lease offsets and of the data section in shard files."""
COPIED_WORD = 8
"""Bytes of the word past a lease's data that says the client's copy is done (a commit
sent while copying: the request's ``copied_nonce``, little-endian)."""
COPIED_FAILED = (1 << 64) - 1
"""XORed with the nonce: the word of a copy that failed."""


@lru_cache(maxsize=1)
def _ml_dtype_names() -> frozenset[str]:
    """The dtype names ml_dtypes defines. Imported on first need: its import takes about
    a second, and a daemon or a torch trainer with only numpy's dtypes never needs it."""
    import ml_dtypes

    return frozenset(
        name
        for name in dir(ml_dtypes)
        if isinstance(getattr(ml_dtypes, name), type)
        and issubclass(getattr(ml_dtypes, name), np.generic)
    )


_SAFETENSORS_CODES = {
    np.dtype("<f8"): "F64",
    np.dtype("<f4"): "F32",
    np.dtype("<f2"): "F16",
    np.dtype("<i8"): "I64",
    np.dtype("<u8"): "U64",
    np.dtype("<i4"): "I32",
    np.dtype("<u4"): "U32",
    np.dtype("<i2"): "I16",
    np.dtype("<u2"): "U16",
    np.dtype("i1"): "I8",
    np.dtype("u1"): "U8",
    np.dtype("?"): "BOOL",
    np.dtype("<c8"): "C64",
}


def round_up(n: int, multiple: int = ALIGN) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


@lru_cache(maxsize=1024)  # a state of thousands of arrays has a handful of dtypes
def dtype_to_str(dt: np.dtype) -> str:
    """Portable name of a dtype: the ml_dtypes name, else numpy's ``dtype.str``."""
    if dt.hasobject:
        raise TypeError(
            f"arrays of dtype {dt} hold Python object pointers and cannot be checkpointed; "
            "convert them to a fixed-size dtype or keep them as JSON-able leaves"
        )
    if dt.type.__module__.startswith("ml_dtypes") and dt.name in _ml_dtype_names():
        return dt.name
    if dt.names is not None or dt.subdtype is not None:
        # Structured and sub-array dtypes round-trip through their descr.
        return "descr:" + json.dumps(dt.descr)
    return dt.str


def str_to_dtype(name: str) -> np.dtype:
    """Inverse of :func:`dtype_to_str`; raises ``ValueError`` naming the bad dtype."""
    dt: np.dtype
    try:
        if name and name[0] in "<>|=":  # numpy's own dtype.str: no ml_dtypes needed
            dt = np.dtype(name)
        elif name in _ml_dtype_names():
            dt = np.dtype(getattr(sys.modules["ml_dtypes"], name))
        elif name.startswith("descr:"):
            dt = np.dtype([tuple(f) for f in json.loads(name[len("descr:") :])])
        else:
            dt = np.dtype(name)
    except (TypeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"unknown dtype {name[:200]!r}: {str(exc)[:200]}") from None
    if dt.hasobject:
        raise ValueError(f"dtype {name!r} holds Python objects and cannot be stored")
    return dt


def safetensors_code(dt: np.dtype) -> str | None:
    """The safetensors dtype code numpy can load, or None if stored as raw U8."""
    return _SAFETENSORS_CODES.get(dt)


class TensorEntry(NamedTuple):
    """One tensor of a shard file: its key and its place in the data section (a tuple:
    a client plans thousands of them per save, at a third of a dataclass's cost)."""

    key: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    length: int


def nbytes_of(dt: np.dtype, shape: Sequence[int]) -> int:
    """Size in bytes of an array of ``shape`` and ``dt``."""
    return math.prod(shape) * dt.itemsize


def _alignment(dt: np.dtype) -> int:
    return max(dt.alignment, dt.itemsize) if dt.kind == "c" else dt.alignment


def plan_layout(items: Iterable[tuple[str, np.dtype, tuple[int, ...]]]) -> list[TensorEntry]:
    """Place tensors contiguously, largest alignment first, so none needs padding.

    Complex numbers are aligned to their whole size (16 bytes for complex128, not
    numpy's 8): torch reads a complex128 tensor that is only 8-aligned with a
    16-byte load and crashes (a restored array handed to ``torch.from_numpy``)."""
    ordered = sorted(items, key=lambda it: -_alignment(it[1]))
    entries = []
    offset = 0
    for key, dt, shape in ordered:
        length = nbytes_of(dt, shape)
        entries.append(TensorEntry(key, dt, tuple(shape), offset, length))
        offset += length
    return entries


def build_header_columns(
    keys: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[list[int]],
    offsets: Sequence[int],
    lengths: Sequence[int],
    metadata: Callable[[dict[str, tuple[str, list[int]]]], dict[str, str]],
) -> bytes:
    """The safetensors header of shards given as columns (dtype names as
    :func:`dtype_to_str` writes them). ``metadata`` makes ``__metadata__`` from the
    shards stored as raw ``U8`` bytes ({key: (dtype name, shape)})."""
    codes: dict[str, str | None] = {d: safetensors_code(str_to_dtype(d)) for d in set(dtypes)}
    raw: dict[str, tuple[str, list[int]]] = {}
    tensors = []
    for key, name, shape, offset, length in zip(
        keys, dtypes, shapes, offsets, lengths, strict=True
    ):
        code = codes[name]
        if code is None:
            raw[key] = (name, shape)
            code, shape = "U8", [length]
        # Formatted, not json.dumps of a dict per tensor: 1.1 vs 2.5 us a tensor. The
        # key is the only string that needs escaping; the rest are codes and integers.
        tensors.append(
            f'{_json_string(key)}:{{"dtype":"{code}","shape":[{",".join(map(str, shape))}],'
            f'"data_offsets":[{offset},{offset + length}]}}'
        )
    meta = json.dumps({"__metadata__": metadata(raw)}, separators=(",", ":"))
    body = meta[:-1] + "".join("," + t for t in tensors) + "}"
    return _pad_header(body.encode())


def _pad_header(body: bytes) -> bytes:
    """Length prefix + ``body``, padded with spaces to a multiple of ALIGN."""
    total = round_up(8 + len(body))
    body += b" " * (total - 8 - len(body))
    return struct.pack("<Q", len(body)) + body
