"""crc32c helpers: combining checksums of consecutive pieces without re-reading them.

``combine(crc_a, crc_b, len_b)`` is the crc32c of ``a + b`` given the checksums
of ``a`` and ``b`` (zlib's crc32_combine, for the Castagnoli polynomial). Parallel
part uploads and ranged downloads checksum each part in C and combine the results
here to check the whole file against the value recorded at local commit.
"""

from __future__ import annotations

import base64
import functools

import google_crc32c

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


def value(data: bytes | memoryview) -> int:
    """crc32c of a bytes-like object."""
    return int(google_crc32c.value(bytes(data) if isinstance(data, memoryview) else data))


def to_base64(crc: int) -> str:
    """The form stores use (GCS ``crc32c``, S3 ``ChecksumCRC32C``): big-endian, base64."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def from_base64(text: str) -> int:
    """Inverse of :func:`to_base64`."""
    return int.from_bytes(base64.b64decode(text), "big")
