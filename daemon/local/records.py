"""A rank file's header and its shards as the manifest records them.

Both are plain functions of a validated commit, so the saver can run them on an
I/O thread when a rank holds many shards (thousands of tensors per rank are the
norm for a transformer with its optimizer state) and inline when it holds few.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ckptd.core.format import build_header_columns
from ckptd.core.shard_table import ShardTable

if TYPE_CHECKING:  # the saver imports this module
    from .pending import CommitRequest

INLINE_SHARDS = 256
"""Ranks with more shards than this get their header and records built on a thread."""


def rank_header(req: CommitRequest) -> tuple[bytes, list[tuple[int, int]]]:
    """The safetensors header of the rank file, and each shard's range in the data."""
    t = req.table
    offsets, lengths = t.offset.tolist(), t.length.tolist()
    header = build_header_columns(t.keys, t.dtypes, t.dims(t.shape), offsets, lengths, _format)
    return header, list(zip(offsets, lengths, strict=True))


def _format(raw: dict[str, tuple[str, list[int]]]) -> dict[str, str]:
    """The header's ``__metadata__``: the true dtype and shape of the tensors stored
    as raw bytes (``U8``), which safetensors readers cannot tell from the file."""
    meta = {"format": "ckptd"}
    if raw:
        meta["dtypes"] = json.dumps({k: [d, s] for k, (d, s) in raw.items()})
    return meta


def shard_records(req: CommitRequest, header_len: int, crcs: list[int]) -> ShardTable:
    """The rank's shards as the manifest holds them: placed after a ``header_len``
    header in its file, with their crc32c."""
    return req.table.placed(req.rank, header_len, crcs)
