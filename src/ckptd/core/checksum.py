"""crc32c: the one verification module of ckptd (client and daemon).

Every byte of a checkpoint is checked against the crc32c recorded when it was
committed: one pass over the lease while it is written (``FileCrc``),
streamed reads of files in bounded chunks (``of_file``, and verify.py; never a
whole file in memory), views of memory already mapped (``of_ranges``), and the
object stores' own checksums, which are plain crc32c of whole objects.

``combine(crc_a, crc_b, len_b)`` is the crc32c of ``a + b`` given the checksums
of ``a`` and ``b`` (zlib's crc32_combine, for the Castagnoli polynomial). Parallel
part uploads and ranged downloads checksum each part in C and combine the results
here to check the whole file against the value recorded at local commit.
"""

from __future__ import annotations

import base64
import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import google_crc32c
import numpy as np

CHUNK = 8 * 2**20
"""Bytes per read when a file is checked from disk."""
_COMBINE_ABOVE = 16 * 2**10
"""Shards at least this long are combined into their file's crc, not checksummed twice
(a combine costs about what checksumming 16 KiB does)."""

_POLY = 0x82F63B78  # Castagnoli, reflected


def _times(mat: tuple[int, ...], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _mul(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(a, col) for col in b)


@functools.cache
def _zeros_operator(log2_bytes: int) -> tuple[int, ...]:
    """The GF(2) matrix that appends 2**log2_bytes zero bytes to a crc register."""
    if log2_bytes == 0:
        one_bit = (_POLY, *(1 << n for n in range(31)))
        op = one_bit
        for _ in range(3):  # 1 -> 2 -> 4 -> 8 zero bits
            op = _mul(op, op)
        return op
    half = _zeros_operator(log2_bytes - 1)
    return _mul(half, half)


@functools.cache
def _zeros_tables(log2_bytes: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """:func:`_zeros_operator` as four 256-entry tables, one per byte of the register:
    applying it is four lookups instead of a loop over 32 bits (a shard's crc is
    folded into its file's once per shard, thousands of times per save)."""
    cols = _zeros_operator(log2_bytes)
    tables = []
    for byte in range(4):
        t = [0] * 256
        for b in range(1, 256):
            low = b & -b  # t[b] = t[b without its lowest bit] ^ that bit's column
            t[b] = t[b ^ low] ^ cols[8 * byte + low.bit_length() - 1]
        tables.append(t)
    return tables[0], tables[1], tables[2], tables[3]


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c of the concatenation ``a + b`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)``."""
    bit = 0
    while len_b:
        if len_b & 1:
            t0, t1, t2, t3 = _zeros_tables(bit)
            crc_a = (
                t0[crc_a & 0xFF]
                ^ t1[(crc_a >> 8) & 0xFF]
                ^ t2[(crc_a >> 16) & 0xFF]
                ^ t3[crc_a >> 24]
            )
        len_b >>= 1
        bit += 1
    return crc_a ^ crc_b


def combine_all(pieces: list[tuple[int, int]]) -> int:
    """crc32c of consecutive pieces given as ``(crc32c, length)`` in order."""
    crc = 0
    for piece_crc, length in pieces:
        crc = combine(crc, piece_crc, length)
    return crc


def value(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """crc32c of a bytes-like object (memoryviews are read in place, not copied)."""
    return extend(0, data)


def extend(crc: int, data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """crc32c of the bytes before (``crc``) followed by ``data``."""
    if isinstance(data, memoryview):
        # google-crc32c takes numpy arrays but not writable memoryviews; this is a view.
        data = np.frombuffer(data, np.uint8)
    return int(google_crc32c.extend(crc, data))


def to_base64(crc: int) -> str:
    """The form stores use (GCS ``crc32c``, S3 ``ChecksumCRC32C``): big-endian, base64."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def from_base64(text: str) -> int:
    """Inverse of :func:`to_base64`."""
    return int.from_bytes(base64.b64decode(text), "big")


def of_ranges(data: memoryview | np.ndarray, ranges: Sequence[tuple[int, int]]) -> list[int]:
    """crc32c of each ``(offset, length)`` slice of ``data``, without copying it."""
    flat = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    return [int(google_crc32c.extend(0, flat[o : o + n])) for o, n in ranges]


class FileCrc:
    """crc32c of a file (header + data) and of each shard in it, fed in order as the
    data lands, so a checksum can trail a write chunk by chunk instead of racing it.

    ``ranges``: each shard's ``(offset, length)`` in the data section, in any order,
    not overlapping; bytes between and after them count only for the whole file.
    One pass over the bytes: a large shard's crc is folded into the file's with
    :func:`combine` (table lookups per set bit of its length) instead of being read
    twice; small shards and the gaps are simply fed to the running value as well.
    """

    def __init__(
        self,
        header: bytes,
        ranges: Sequence[tuple[int, int]],
        data_length: int,
        pieces: Pieces | None = None,
    ) -> None:
        self._pieces = pieces if pieces is not None else file_pieces(ranges, data_length)
        self._next = 0  # the piece being read
        self._pos = 0  # data bytes consumed
        self._shard = 0  # the running crc of the shard being read
        self._whole = int(google_crc32c.value(header))
        self._crcs = [0] * len(ranges)

    def feed(self, data: np.ndarray, upto: int) -> None:
        """Take in the data section's bytes up to ``upto`` (``data``: all of it, as
        flat uint8; bytes past ``upto`` are not read). Calls must come in order;
        one that reaches no further than the last is a no-op."""
        # Thousands of shards per call: locals, one branch per piece, and the file's
        # crc extended once per run of unfolded pieces, not once per piece.
        pieces, extend, crcs = self._pieces, google_crc32c.extend, self._crcs
        i, pos, whole, shard = self._next, self._pos, self._whole, self._shard
        unfolded = pos  # bytes from here to pos are not in whole yet
        while i < len(pieces):
            end, index, folded = pieces[i]
            cut = end if end <= upto else upto  # the piece ends here, or what landed does
            if folded and unfolded < pos:
                whole = extend(whole, data[unfolded:pos])
            if cut > pos:
                if index >= 0:
                    shard = extend(shard, data[pos:cut])
                pos = cut
            if folded:
                unfolded = pos
            if end > upto:
                break
            if index >= 0:
                crcs[index] = shard
                if folded:
                    whole = combine(whole, shard, end - (pieces[i - 1][0] if i else 0))
                shard = 0
            i += 1
        if unfolded < pos:
            whole = extend(whole, data[unfolded:pos])
        self._next, self._pos, self._whole, self._shard = i, pos, whole, shard

    def result(self) -> tuple[int, list[int]]:
        """``(whole file's crc32c, [each shard's])``; raises if not all data was fed."""
        if self._next < len(self._pieces):
            raise ValueError(f"only {self._pos} bytes of the data were checksummed")
        return self._whole, self._crcs


Pieces = list[tuple[int, int, bool]]
"""A data section in order: each piece's end, its shard's index (-1: a gap), folded."""


def file_pieces(ranges: Sequence[tuple[int, int]], data_length: int) -> Pieces:
    """How :class:`FileCrc` walks a data section holding shards at ``ranges`` (the same
    for every save of an unchanged structure, so callers may keep it)."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    pieces: Pieces = []
    at = 0
    for i in order:
        offset, length = ranges[i]
        if offset < at:
            raise ValueError(f"shard {i} at {offset} overlaps the one before, ending at {at}")
        if offset > at:
            pieces.append((offset, -1, False))
        pieces.append((offset + length, i, _folded(length)))
        at = offset + length
    if data_length > at:
        pieces.append((data_length, -1, False))
    return pieces


def _folded(length: int) -> bool:
    """Whether a shard of ``length`` bytes is combined into its file's crc rather than
    checksummed a second time: a combine costs ~0.5 us per set bit of the length
    (1.5 us for a layer's 589,824 bytes, ~7 us for a length like 2**30 - 12345),
    checksumming ~1 us per 12 KB."""
    return length >= _COMBINE_ABOVE and length.bit_count() * 8192 <= length


def of_file(path: Path, chunk: int = CHUNK, progress: Callable[[int], None] | None = None) -> int:
    """crc32c of a whole file, streamed in chunks of ``chunk`` bytes."""
    return of_file_ranges(path, None, chunk, progress)[0]


def of_file_ranges(
    path: Path,
    ranges: Sequence[tuple[int, int]] | None,
    chunk: int = CHUNK,
    progress: Callable[[int], None] | None = None,
) -> list[int]:
    """crc32c of each ``(offset, length)`` range of a file (``None``: the whole file),
    streamed through one reused buffer of ``chunk`` bytes, ``progress(n)`` called
    after each chunk of ``n`` bytes read. A range past the end of the file raises
    ``ValueError``."""
    buf = bytearray(chunk)
    view = np.frombuffer(buf, np.uint8)
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        if ranges is None:
            ranges = [(0, os.fstat(fd).st_size)]
        out = []
        for offset, length in ranges:
            crc, pos = 0, 0
            while pos < length:
                n = os.preadv(fd, [memoryview(buf)[: min(chunk, length - pos)]], offset + pos)
                if n <= 0:
                    raise ValueError(f"{path} ends at byte {offset + pos}, inside a checked range")
                crc = int(google_crc32c.extend(crc, view[:n]))
                pos += n
                if progress is not None:
                    progress(n)
            out.append(crc)
    return out
