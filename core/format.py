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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

ALIGN = 4096
"""Page alignment of lease offsets and of the data section in shard files."""

_ML_DTYPE_NAMES = frozenset(
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


def dtype_to_str(dt: np.dtype) -> str:
    """Portable name of a dtype: the ml_dtypes name, else numpy's ``dtype.str``."""
    if dt.hasobject:
        raise TypeError(
            f"arrays of dtype {dt} hold Python object pointers and cannot be checkpointed; "
            "convert them to a fixed-size dtype or keep them as JSON-able leaves"
        )
    if dt.type.__module__.startswith("ml_dtypes") and dt.name in _ML_DTYPE_NAMES:
        return dt.name
    if dt.names is not None or dt.subdtype is not None:
        # Structured and sub-array dtypes round-trip through their descr.
        return "descr:" + json.dumps(dt.descr)
    return dt.str


def str_to_dtype(name: str) -> np.dtype:
    """Inverse of :func:`dtype_to_str`; raises ``ValueError`` naming the bad dtype."""
    dt: np.dtype
    try:
        if name in _ML_DTYPE_NAMES:
            dt = np.dtype(getattr(ml_dtypes, name))
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


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard file: its key and its place in the data section."""

    key: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    length: int


def nbytes_of(dt: np.dtype, shape: Sequence[int]) -> int:
    """Size in bytes of an array of ``shape`` and ``dt``."""
    return math.prod(shape) * dt.itemsize


def plan_layout(items: Iterable[tuple[str, np.dtype, tuple[int, ...]]]) -> list[TensorEntry]:
    """Place tensors contiguously, largest alignment first, so none needs padding."""
    ordered = sorted(items, key=lambda it: -it[1].alignment)
    entries = []
    offset = 0
    for key, dt, shape in ordered:
        length = nbytes_of(dt, shape)
        entries.append(TensorEntry(key, dt, tuple(shape), offset, length))
        offset += length
    return entries


def check_layout(entries: Sequence[TensorEntry]) -> int:
    """Validate a layout received from a client; returns the data-section size.

    Raises ``ValueError`` with the offending key if tensors overlap, leave
    holes, are misaligned or their length disagrees with dtype and shape.
    """
    end = 0
    seen: set[str] = set()
    for e in sorted(entries, key=lambda x: (x.offset, x.length)):
        if e.key in seen:
            raise ValueError(f"duplicate shard key {e.key!r}")
        seen.add(e.key)
        want = nbytes_of(e.dtype, e.shape)
        if e.length != want:
            raise ValueError(
                f"shard {e.key!r}: length {e.length} != {want} bytes for shape {list(e.shape)} "
                f"of {e.dtype}"
            )
        if e.offset != end:
            raise ValueError(
                f"shard {e.key!r} starts at {e.offset} but the previous shard ends at {end}: "
                "shards must be packed back to back with no holes or overlaps"
            )
        if e.length and e.offset % e.dtype.alignment:
            raise ValueError(f"shard {e.key!r} at offset {e.offset} is not aligned to its dtype")
        end = e.offset + e.length
    return end


def build_header(entries: Sequence[TensorEntry], metadata: dict[str, str]) -> bytes:
    """The safetensors header (length prefix + JSON), padded to a multiple of ALIGN."""
    header: dict[str, object] = {"__metadata__": metadata}
    for e in entries:
        code = safetensors_code(e.dtype)
        if code is None:
            header[e.key] = {
                "dtype": "U8",
                "shape": [e.length],
                "data_offsets": [e.offset, e.offset + e.length],
            }
        else:
            header[e.key] = {
                "dtype": code,
                "shape": list(e.shape),
                "data_offsets": [e.offset, e.offset + e.length],
            }
    body = json.dumps(header, separators=(",", ":")).encode()
    total = round_up(8 + len(body))
    body += b" " * (total - 8 - len(body))
    return struct.pack("<Q", len(body)) + body
