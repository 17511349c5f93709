"""A rank file's header and its shard records: per-shard work, kept off the event loop.

Both are plain functions of a validated commit, so the saver can run them on an
I/O thread when a rank holds many shards (thousands of tensors per rank are the
norm for a transformer with its optimizer state) and inline when it holds few.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ckptd.core.format import build_header
from ckptd.core.manifest import ShardRecord

if TYPE_CHECKING:  # the saver imports this module
    from .saver import CommitRequest

INLINE_SHARDS = 256
"""Ranks with more shards than this get their header and records built on a thread."""


def rank_header(req: CommitRequest) -> tuple[bytes, list[tuple[int, int]]]:
    """The safetensors header of the rank file, and each shard's range in the data."""
    header = build_header(
        req.entries,
        {
            "format": "ckptd",
            "dtypes": json.dumps(
                {e.key: [req.dtype_names[e.key], list(e.shape)] for e in req.entries}
            ),
        },
    )
    return header, [(e.offset, e.length) for e in req.entries]


def shard_records(
    req: CommitRequest, name: str, header_len: int, crcs: list[int]
) -> list[ShardRecord]:
    """The manifest's records of the rank's shards, placed after a ``header_len`` header."""
    return [
        ShardRecord(
            e.key,
            req.rank,
            req.dtype_names[e.key],
            list(e.shape),
            list(req.global_shapes[e.key]),
            [list(s) for s in req.indexes[e.key]],
            name,
            header_len + e.offset,
            e.length,
            crc,
        )
        for e, crc in zip(req.entries, crcs, strict=True)
    ]
