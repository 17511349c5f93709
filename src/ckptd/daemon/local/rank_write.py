"""A rank file written whole from its lease: the save path's write when no earlier
step's file is reused (increment.py writes the other kind).

The shards go from the lease to ``<staging dir>/rank-N.safetensors`` with
``O_DIRECT`` in chunks, each chunk's crc32c and NaN/Inf count computed while the
next is written (files.py); a spare file of the right size is reused when the store
has one (store.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ckptd.core.health import NonFiniteCount
from ckptd.core.manifest import RankRecord, rank_file_name
from ckptd.core.shard_table import ShardTable

from ..files import write_file_checksummed
from .pending import CommitRequest, PendingStep
from .records import INLINE_SHARDS, RankLayout, shard_records

Run = Callable[..., Awaitable[Any]]
"""Runs a blocking call on the I/O threads (``IoPool.run``, with the step's ticket)."""


async def write_whole(
    run: Run,
    pending: PendingStep,
    req: CommitRequest,
    layout: RankLayout,
    data: memoryview,
    data_len: int,
    digests: Any,
    spare: Path | None,
) -> tuple[RankRecord, ShardTable]:
    """Write rank ``req.rank`` of ``pending`` whole; its record and its shards'
    records. ``digests``: the shards' digests when an incremental scan computed them
    (kept in the record for the next save's comparison)."""
    header, name = layout.header, rank_file_name(req.rank)
    health = NonFiniteCount(req.table.keys, layout.floats)
    file_crc, crcs = await run(
        write_file_checksummed,
        pending.commit.path / name,
        header,
        data,
        data_len,
        layout.ranges,
        spare,
        layout.pieces,
        health,
    )
    pending.nonfinite[req.rank] = health.result()
    args = (req, len(header), crcs)
    many = len(req.table) > INLINE_SHARDS
    shards = await run(shard_records, *args) if many else shard_records(*args)
    size = len(header) + data_len
    return RankRecord(req.rank, name, size, file_crc, req.tree, digests=digests), shards
