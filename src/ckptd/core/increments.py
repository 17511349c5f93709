"""Incremental rank files: only what changed, and references for the rest.

A rank's *image* is the safetensors file a full save writes: the header, then
every shard back to back. An incremental step's rank file holds only some ranges
of that image, its *runs* (the header and the shards that changed, each rounded
out to whole 4 KiB blocks and merged, so they go to disk with aligned
``O_DIRECT`` writes straight from the lease), one after the other. Every other
shard is a *reference*: the same image range, byte for byte, in the rank file of
an older step of the job that holds it in its own runs (references are never
chained: a step that reuses a shard its predecessor referenced points where the
predecessor pointed). Restore reads each reference's range from its holder's
file and the runs from the step's own, into one buffer laid out as the image,
and checks the image's crc32c, which the manifest records beside the file's.

A shard is reused only when it is known to be the holder's bytes: the same
place in the image (key, dtype, shape, offset, length), the same crc32c, and
either the trainer's word (a tensor whose storage and version did not change, the
same immutable jax array) or an equal strong digest (:data:`DIGEST`). The 32-bit
crc alone is never enough: over millions of shards a collision is not rare.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import checksum
from .errors import InvalidArgument
from .format import ALIGN
from .shard_table import ShardTable

DIGEST = "sha256"
"""The strong digest of a shard without the trainer's word (SHA-NI: ~1.5 GB/s a core)."""
DIGEST_HEX = 32
"""Hex characters kept of each digest (128 bits)."""


def digest(data: memoryview) -> str:
    """The strong digest of one shard's bytes, as stored in a manifest (hashlib lets
    go of the GIL over large buffers, so digests run on threads side by side)."""
    return hashlib.new(DIGEST, data).hexdigest()[:DIGEST_HEX]


@dataclass(frozen=True)
class Ref:
    """An image range of this rank held in an older step's rank file of the same rank."""

    start: int
    """Offset in this step's image."""
    length: int
    step: int
    """The step whose rank file holds the bytes (in its own runs)."""
    offset: int
    """Where the range starts in that step's rank file."""
    crc32c: int

    def as_list(self) -> list[int]:
        """The manifest's form: ``[start, length, step, offset, crc32c]``."""
        return [self.start, self.length, self.step, self.offset, self.crc32c]


def refs_of(raw: Any) -> list[Ref]:
    """A rank record's ``refs`` as :class:`Ref` (none for a full file)."""
    return [Ref(*map(int, r)) for r in raw or ()]


def round_runs(ranges: Sequence[tuple[int, int]], image_size: int) -> list[tuple[int, int]]:
    """``(start, length)`` image ranges, sorted by start, rounded out to whole blocks
    (the last clipped at the image's end) and merged where they touch."""
    runs: list[list[int]] = []
    for start, length in ranges:
        if length <= 0:
            continue
        lo = start - start % ALIGN
        hi = min(-(-(start + length) // ALIGN) * ALIGN, image_size)
        if runs and lo <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], hi)
        else:
            runs.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in runs]


def file_offset(runs: Sequence[Sequence[int]], start: int, length: int) -> int:
    """Where image range ``[start, start + length)`` lies in a file made of ``runs``
    (``(image start, length)`` each, in file order); ValueError if no one run holds it."""
    starts = [r[0] for r in runs]
    i = bisect.bisect_right(starts, start) - 1
    if i < 0 or start + length > runs[i][0] + runs[i][1]:
        raise ValueError(f"image range [{start}, {start + length}) is not in the file's runs")
    return sum(r[1] for r in runs[:i]) + start - runs[i][0]


def holder_of(
    runs: Sequence[Sequence[int]] | None, refs: Sequence[Ref], step: int, start: int, length: int
) -> tuple[int, int]:
    """Which step's file holds image range ``[start, start + length)`` of a step
    (``step``, made of ``runs`` and ``refs``), and at what offset: ``(step, offset)``."""
    if refs:
        i = bisect.bisect_right([r.start for r in refs], start) - 1
        if i >= 0 and start + length <= refs[i].start + refs[i].length:
            ref = refs[i]
            return ref.step, ref.offset + start - ref.start
    if runs is None:  # a full file: the image itself
        return step, start
    return step, file_offset(runs, start, length)


@dataclass(frozen=True)
class Previous:
    """The step a save may reuse shards of: its number, and this rank's record of it."""

    step: int
    runs: list[list[int]] | None
    refs: list[Ref]
    table: ShardTable
    """The rank's shards in that step (image offsets, crc32c)."""
    digests: list[str] | None


def candidates(keys: Sequence[str], crcs: Sequence[int], prev: Previous) -> np.ndarray:
    """Per shard: whether ``prev`` has a shard of the same key with the same crc32c (it
    may hold the same bytes: a strong digest decides)."""
    where = {k: i for i, k in enumerate(prev.table.keys)}
    p_crcs = prev.table.crc32c.tolist()
    return np.fromiter(
        (
            (j := where.get(k)) is not None and p_crcs[j] == int(c)
            for k, c in zip(keys, crcs, strict=True)
        ),
        bool,
        len(keys),
    )


def reuse(
    table: ShardTable,
    crcs: Sequence[int],
    prev: Previous,
    claimed: np.ndarray | None,
    digests: Sequence[str] | None,
) -> tuple[np.ndarray, list[Ref], list[str] | None]:
    """Which shards of ``table`` (this save's rank, image offsets) ``prev`` already holds:
    a bool per row, the references for them (merged where one holder's ranges run on),
    and each reused shard's digest inherited from ``prev`` (for a later save to compare).

    ``claimed``: the trainer's word per row that a shard did not change since ``prev``;
    ``digests``: this save's digest per row (``""``: not computed). A shard is reused
    only with its place and crc32c equal and the word or an equal digest."""
    where = {k: i for i, k in enumerate(prev.table.keys)}
    n = len(table)
    reused = np.zeros(n, bool)
    found: list[tuple[int, int, int, int, int]] = []  # start, length, step, offset, crc
    inherited: list[str] | None = [""] * n if (digests or prev.digests) else None
    offs, lens = table.offset.tolist(), table.length.tolist()
    p_offs, p_lens = prev.table.offset.tolist(), prev.table.length.tolist()
    p_crcs = prev.table.crc32c.tolist()
    shapes, p_shapes = table.dims(table.shape), prev.table.dims(prev.table.shape)
    for i, key in enumerate(table.keys):
        j = where.get(key)
        if j is None or lens[i] == 0:
            continue
        if (
            offs[i] != p_offs[j]
            or lens[i] != p_lens[j]
            or int(crcs[i]) != p_crcs[j]
            or table.dtypes[i] != prev.table.dtypes[j]
            or shapes[i] != p_shapes[j]
        ):
            continue
        old = prev.digests[j] if prev.digests else ""
        word = claimed is not None and bool(claimed[i])
        if not (word or (digests and digests[i] and digests[i] == old)):
            continue
        step, offset = holder_of(prev.runs, prev.refs, prev.step, offs[i], lens[i])
        reused[i] = True
        found.append((offs[i], lens[i], step, offset, int(crcs[i])))
        if inherited is not None:
            inherited[i] = digests[i] if digests and digests[i] else old
    return reused, _merged(found), inherited


def _merged(found: list[tuple[int, int, int, int, int]]) -> list[Ref]:
    """References sorted by image offset, one per run of ranges that continue each
    other both in the image and in one holder's file (their crc32c combined)."""
    out: list[list[int]] = []
    for start, length, step, offset, crc in sorted(found):
        last = out[-1] if out else None
        if (
            last is not None
            and last[2] == step
            and last[0] + last[1] == start
            and last[3] + last[1] == offset
        ):
            last[4] = checksum.combine(last[4], crc, length)
            last[1] += length
        else:
            out.append([start, length, step, offset, crc])
    return [Ref(*r) for r in out]


def own_ranges(header_len: int, table: ShardTable, reused: np.ndarray) -> list[tuple[int, int]]:
    """The image ranges this save writes itself: the header and every shard not reused,
    sorted by offset."""
    rows = np.flatnonzero(~reused)
    pairs = sorted(zip(table.offset[rows].tolist(), table.length[rows].tolist(), strict=True))
    return [(0, header_len), *pairs]


def check_record(
    step: int, size: int, image_size: int, runs: Any, refs: list[Ref], table: ShardTable
) -> None:
    """An incremental rank record read from a manifest must describe a file ckptd
    could have written: runs in order inside the image, adding up to the file's size;
    references to older steps, inside the image; every shard in a run or a reference.
    Raises InvalidArgument naming what is wrong."""
    if not isinstance(runs, list) or not runs:
        raise InvalidArgument("runs must be a non-empty list of [image offset, length]")
    total, end = 0, 0
    for run in runs:
        if not (isinstance(run, list) and len(run) == 2 and all(type(v) is int for v in run)):
            raise InvalidArgument(f"run {str(run)[:60]} is not [image offset, length]")
        start, length = run
        if start < end or length <= 0 or start + length > image_size:
            raise InvalidArgument(f"run [{start}, {length}] overlaps or leaves the image")
        total, end = total + length, start + length
    if total != size:
        raise InvalidArgument(f"runs add up to {total} bytes, the file has {size}")
    end = 0
    for ref in refs:
        if ref.start < end or ref.length <= 0 or ref.start + ref.length > image_size:
            raise InvalidArgument(f"reference at {ref.start} overlaps or leaves the image")
        if not 0 <= ref.step < step or ref.offset < 0 or not 0 <= ref.crc32c < 2**32:
            raise InvalidArgument(f"reference at {ref.start} names step {ref.step} of {step}")
        end = ref.start + ref.length
    for key, off, n in zip(table.keys, table.offset.tolist(), table.length.tolist(), strict=True):
        if n == 0:
            continue
        try:
            holder_of(runs, refs, step, off, n)
        except ValueError:
            raise InvalidArgument(f"shard {key[:80]!r} is in no run and no reference") from None


def check_rank(step: int, r: Any, table: ShardTable) -> None:
    """A manifest's rank record (``core.manifest.RankRecord``): its incremental fields
    must all be there or none, and describe a file ckptd could have written."""
    at = f"rank {r.rank}"
    mine = table.of_rank(r.rank)
    if r.digests is not None and (
        not isinstance(r.digests, list)
        or len(r.digests) != len(mine)
        or not all(isinstance(d, str) for d in r.digests)
    ):
        raise InvalidArgument(f"{at}: digests must be one text per shard")
    if r.runs is None:
        if any(v is not None for v in (r.refs, r.image_size, r.image_crc32c)):
            raise InvalidArgument(f"{at}: references or an image without runs")
        return
    if r.image_size is None or r.image_crc32c is None or not isinstance(r.refs, list):
        raise InvalidArgument(f"{at}: runs without refs, image_size and image_crc32c")
    for name, value in (("image_size", r.image_size), ("image_crc32c", r.image_crc32c)):
        if type(value) is not int or not 0 <= value < (2**32 if "crc" in name else 2**62):
            raise InvalidArgument(f"{at}.{name} = {str(value)[:40]} is out of range")
    try:
        refs = refs_of(r.refs)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{at}: refs must be [start, length, step, offset, crc32c]") from None
    check_record(step, r.size, r.image_size, r.runs, refs, mine)
