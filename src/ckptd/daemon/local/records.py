"""A rank file's header and its shards as the manifest records them.

Both are plain functions of a validated commit, so the saver can run them on an
I/O thread when a rank holds many shards (thousands of tensors per rank are the
norm for a transformer with its optimizer state) and inline when it holds few.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

from ckptd.core import checksum, health
from ckptd.core.format import build_header_columns
from ckptd.core.shard_table import ShardTable

if TYPE_CHECKING:  # the saver imports this module
    from .pending import CommitRequest

INLINE_SHARDS = 256
"""Ranks with more shards than this get their header and records built on a thread."""


class RankLayout(NamedTuple):
    """A rank file's header, and where its shards lie in the data section."""

    header: bytes
    ranges: list[tuple[int, int]]
    """Each shard's ``(offset, length)`` in the data, in the commit's order."""
    pieces: checksum.Pieces
    """How the checksum walks the data (:func:`~ckptd.core.checksum.file_pieces`)."""
    floats: health.Plan
    """The shards whose NaN/Inf are counted (:func:`~ckptd.core.health.plan`)."""


def rank_layout(req: CommitRequest) -> RankLayout:
    """The safetensors header of the rank file, and each shard's range in the data."""
    t = req.table
    offsets, lengths = t.offset.tolist(), t.length.tolist()
    header = build_header_columns(t.keys, t.dtypes, t.dims(t.shape), offsets, lengths, _format)
    ranges = list(zip(offsets, lengths, strict=True))
    pieces = checksum.file_pieces(ranges, t.check_layout())
    return RankLayout(header, ranges, pieces, health.plan(t.dtypes, ranges))


class RankLayouts:
    """Each (job, rank)'s last layout, kept while its commits carry the same checked
    table object (the request parser hands one table to every commit of an unchanged
    structure): building a transformer's again cost ~1.5 us per shard."""

    def __init__(self, keep: int = 256) -> None:
        self._keep = keep
        self._last: OrderedDict[tuple[str, int], tuple[ShardTable, RankLayout]] = OrderedDict()

    def get(self, req: CommitRequest) -> RankLayout | None:
        """The layout of ``req`` if its table is the one seen last."""
        last = self._last.get((req.job, req.rank))
        return last[1] if last is not None and last[0] is req.table else None

    def put(self, req: CommitRequest, layout: RankLayout) -> None:
        """Remember ``req``'s layout."""
        key = (req.job, req.rank)
        self._last[key] = (req.table, layout)
        self._last.move_to_end(key)
        while len(self._last) > self._keep:
            self._last.popitem(last=False)


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
