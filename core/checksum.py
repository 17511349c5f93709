"""crc32c: the one verification module of ckptd (client and daemon).

Every byte of a checkpoint is checked against the crc32c recorded when it was
committed: one pass over the lease while it is written (``of_file_and_shards``),
streamed reads of files in bounded chunks (``of_file``, ``verify_step``; never a
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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import google_crc32c
import numpy as np

if TYPE_CHECKING:
    from .manifest import Manifest

CHUNK = 8 * 2**20
"""Bytes per read when a file is checked from disk."""
_COMBINE_ABOVE = 2**20  # shards at least this long are combined, not checksummed twice

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


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c of the concatenation ``a + b`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)``."""
    bit = 0
    while len_b:
        if len_b & 1:
            crc_a = _times(_zeros_operator(bit), crc_a)
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


def of_file_and_shards(
    header: bytes, data: memoryview, data_length: int, ranges: Sequence[tuple[int, int]]
) -> tuple[int, list[int]]:
    """crc32c of the whole file (header + data) and of each shard, from memory.

    The whole-file value is what object stores report natively (GCS crc32c, S3
    CRC32C), so the drain can verify an upload end to end without re-reading.
    """
    # One pass over the bytes: each shard's crc is folded into the file's with
    # combine (a few hundred integer ops) instead of being read twice; small
    # shards and the alignment gaps are simply fed to the running value.
    flat = np.frombuffer(data, np.uint8)
    whole = int(google_crc32c.value(header))
    shard_crcs = [0] * len(ranges)
    pos = 0
    for i in sorted(range(len(ranges)), key=lambda i: ranges[i][0]):
        offset, length = ranges[i]
        if offset > pos:
            whole = int(google_crc32c.extend(whole, flat[pos:offset]))
        piece = flat[offset : offset + length]
        shard_crcs[i] = int(google_crc32c.extend(0, piece))
        if length >= _COMBINE_ABOVE:
            whole = combine(whole, shard_crcs[i], length)
        else:
            whole = int(google_crc32c.extend(whole, piece))
        pos = max(pos, offset + length)
    if pos < data_length:
        whole = int(google_crc32c.extend(whole, flat[pos:data_length]))
    return whole, shard_crcs


def of_file(path: Path, chunk: int = CHUNK) -> int:
    """crc32c of a whole file, streamed in chunks of ``chunk`` bytes."""
    return of_file_ranges(path, None, chunk)[0]


def of_file_ranges(
    path: Path, ranges: Sequence[tuple[int, int]] | None, chunk: int = CHUNK
) -> list[int]:
    """crc32c of each ``(offset, length)`` range of a file (``None``: the whole file),
    streamed through one reused buffer of ``chunk`` bytes. A range past the end of
    the file raises ``ValueError``."""
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
            out.append(crc)
    return out


def verify_step(directory: Path, manifest: Manifest) -> list[str]:
    """Re-read a committed step's files and compare every crc32c the manifest records;
    returns what does not match (empty if intact). Adopted trees: each whole file;
    ckptd's rank files: each shard."""
    bad: list[str] = []
    if manifest.adopted:
        for r in manifest.ranks:
            try:
                if of_file(directory / r.file) != r.crc32c:
                    bad.append(r.file)
            except (OSError, ValueError) as exc:
                bad.append(f"{r.file}: {exc}")
        return bad
    for r in manifest.ranks:
        t = manifest.shards.of_rank(r.rank)
        shards = list(
            zip(t.keys, t.offset.tolist(), t.length.tolist(), t.crc32c.tolist(), strict=True)
        )
        bad += _verify_rank_file(directory / r.file, r.size, r.crc32c, shards)
    return bad


def _verify_rank_file(
    path: Path, size: int, file_crc: int, shards: list[tuple[str, int, int, int]]
) -> list[str]:
    """One pass over a rank file: each shard's crc32c, and the whole file's (which
    also covers the header and the padding between shards)."""
    pieces: list[tuple[int, int, int | None]] = []  # offset, length, index into shards
    at = 0
    for i, (_, offset, length, _) in sorted(enumerate(shards), key=lambda x: x[1][1]):
        if offset > at:
            pieces.append((at, offset - at, None))
        pieces.append((offset, length, i))
        at = max(at, offset + length)
    if size > at:
        pieces.append((at, size - at, None))
    try:
        actual = path.stat().st_size
        if actual != size:
            return [f"{path.name}: {actual} bytes, {size} recorded at commit"]
        crcs = of_file_ranges(path, [(o, n) for o, n, _ in pieces])
    except (OSError, ValueError) as exc:
        return [f"{path.name}: {exc}"]
    bad = [
        f"{path.name}:{shards[i][0]}"
        for (_, _, i), c in zip(pieces, crcs, strict=True)
        if i is not None and c != shards[i][3]
    ]
    whole = combine_all([(c, n) for c, (_, n, _) in zip(crcs, pieces, strict=True)])
    if not bad and whole != file_crc:
        bad.append(f"{path.name}: header or padding differs from the commit")
    return bad
