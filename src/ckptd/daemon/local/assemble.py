"""An incremental rank's image, assembled in shared memory from the files that hold it.

The step's own file holds its runs; each reference's range is in an older step's
file of the same rank (core/increments.py). Both are read with aligned
``O_DIRECT`` reads straight into the segment, at the range's place in the image:
a reference is read rounded out to whole blocks (the holder keeps the range at the
same offset within a block as the image does, because both are laid out alike),
which also brings the holder's bytes of the neighbouring block ends; the holders
go oldest first and the step's own runs last, so every neighbour is then
overwritten by a newer copy of the same bytes or by the step's own. Then the
whole image's crc32c is checked against the one recorded at commit, on the crc
threads, chunk by chunk; a mismatch is narrowed down to the shards that differ.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

from ckptd.core import checksum
from ckptd.core.format import ALIGN, round_up
from ckptd.core.increments import Ref, refs_of
from ckptd.core.manifest import RankRecord
from ckptd.core.shard_table import ShardTable

from .. import faults
from ..files import open_direct, read_header
from ..io import CRC

CHUNK = 8 * 2**20
"""Bytes per read, and per crc piece."""


def read_increment(
    path: Path,
    record: RankRecord,
    holders: dict[int, Path],
    view: memoryview,
    table: ShardTable,
) -> tuple[int, list[str]]:
    """Assemble ``record``'s image (its data section into ``view``); returns the
    header's length and what does not match (empty if intact). ``holders``: each
    referenced step's rank file."""
    faults.hit("restore.read")
    assert record.runs is not None and record.image_size is not None
    head = record.runs[0][1] if record.runs[0][0] == 0 else 0
    head = _header_length(path, head)
    refs = refs_of(record.refs)
    data_len = record.image_size - head
    if len(view) < round_up(data_len):
        raise ValueError("segment shorter than the image's data")
    try:
        header = read_header(path, head)
        with contextlib.ExitStack() as files:  # each file opened once, read in place
            fds = {p: files.enter_context(_opened(p)) for p in {path, *holders.values()}}
            for ref in sorted(refs, key=lambda r: (r.step, r.start)):
                _read_ref(holders[ref.step], fds[holders[ref.step]], ref, view, head)
            at = 0
            for start, length in record.runs:
                if start == 0:  # the header's run: its data part
                    _read(path, fds[path], at + head, view, 0, length - head)
                else:
                    _read(path, fds[path], at, view, start - head, length)
                at += length
    except ValueError as exc:  # short: corrupt (an OSError is the disk's, and is raised)
        return head, [f"{record.file}: {exc}"]
    if _image_crc(header, view, data_len) == record.image_crc:
        return head, []
    shards = table.of_rank(record.rank)
    ranges = list(zip((shards.offset - head).tolist(), shards.length.tolist(), strict=True))
    got = checksum.of_ranges(view, ranges)
    want = shards.crc32c.tolist()
    bad = [f"{record.file}:{k}" for k, c, w in zip(shards.keys, got, want, strict=True) if c != w]
    return head, bad or [f"{record.file}: its header differs from the commit"]


def _header_length(path: Path, first_run: int) -> int:
    """The safetensors header's length (8 + its size field, padded to a block), read
    from the file; checked to lie inside the first run."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        raw = os.pread(fd, 8, 0)
    finally:
        os.close(fd)
    if len(raw) != 8:
        raise ValueError(f"{path} is too short to be a rank file")
    head = 8 + int.from_bytes(raw, "little")
    if head % ALIGN or not 8 < head <= first_run:
        raise ValueError(f"{path}: a header of {head} bytes does not fit its first run")
    return head


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[int]:
    """``path`` opened for aligned ``O_DIRECT`` reads (buffered where refused)."""
    fd, _ = open_direct(path, os.O_RDONLY)
    try:
        yield fd
    finally:
        os.close(fd)


def _read_ref(path: Path, fd: int, ref: Ref, view: memoryview, head: int) -> None:
    """A reference's range from its holder's file, rounded out to whole blocks."""
    skew = ref.start % ALIGN
    if ref.offset % ALIGN != skew:
        raise ValueError(f"{path}: a reference at {ref.start} is not laid out as the image")
    lo = ref.start - skew - head
    _read(path, fd, ref.offset - skew, view, lo, ref.length + skew)


def _read(path: Path, fd: int, offset: int, view: memoryview, at: int, length: int) -> None:
    """``length`` bytes of ``fd`` (``path``) from ``offset`` (block-aligned) into
    ``view[at:]``, in whole blocks (the kernel stops at the end of the file)."""
    pos, end = 0, round_up(length)
    while pos < length:
        n = min(CHUNK, end - pos)
        got = os.preadv(fd, [view[at + pos : at + pos + n]], offset + pos)
        if got <= 0 or (got % ALIGN and pos + got < length):
            raise ValueError(f"{path.name} ends {length - pos - max(got, 0)} bytes early")
        pos += got


def _image_crc(header: bytes, view: memoryview, data_len: int) -> int:
    """crc32c of the header and the assembled data, the data in chunks on the crc threads."""
    pieces: list[tuple[Future[int], int]] = [
        (CRC.submit(checksum.value, view[pos : pos + min(CHUNK, data_len - pos)]), n)
        for pos in range(0, data_len, CHUNK)
        for n in [min(CHUNK, data_len - pos)]
    ]
    data_crc = checksum.combine_all([(f.result(), n) for f, n in pieces])
    return checksum.combine(checksum.value(header), data_crc, data_len)


def write_image(
    path: Path, record: RankRecord, holders: dict[int, Path], table: ShardTable, out: Path
) -> list[str]:
    """Write ``record``'s whole image (the rank file a full save would have written) to
    a new file ``out``, from the step's own file ``path`` and its holders' files, read
    straight into ``out``'s pages; returns what does not match (empty: its crc32c is
    the one recorded at commit). A pulled step is then whole on its own."""
    assert record.runs is not None and record.image_size is not None
    head = _header_length(path, record.runs[0][1] if record.runs[0][0] == 0 else 0)
    data_len = record.image_size - head
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.ftruncate(fd, head + round_up(data_len))
        with mmap.mmap(fd, round_up(data_len), offset=head) as mm:
            view = memoryview(mm)
            try:
                _, bad = read_increment(path, record, holders, view, table)
            finally:
                view.release()
        os.pwrite(fd, read_header(path, head), 0)
        os.ftruncate(fd, record.image_size)
        os.fsync(fd)
    finally:
        os.close(fd)
    return bad
