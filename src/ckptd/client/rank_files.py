"""Where a rank's bytes are on disk: its own file, or an older step's (incremental saves).

A full rank file is the rank's *image* (the header, then every shard; the manifest's
shard offsets are offsets in it). An incremental one holds only some image ranges
(its ``runs``); every other shard is a reference to the same rank's file of an older
step of the job, its *holder* (core/increments.py). The holder's files lie beside
the step's: the local tier keeps ``<root>/<job>/<step>/``, so a holder is the
sibling ``<root>/<job>/<holder>/``; another node's part fetched for a restore lies
in ``<peers>/<job>/<step>/<node>/``, so its holder is ``<peers>/<job>/<holder>/<node>/``.
The daemon grants a restore's holder directories with the step's own.

Readers that take a shard at a time (:class:`~ckptd.client.shards.ShardReader`)
ask :class:`Locator` for its file and offset; a whole-rank restore from files
(:func:`map_image`) maps each file copy-on-write and views every shard where it
lies, as a full rank's file is mapped whole.
"""

from __future__ import annotations

import bisect
import fcntl
import mmap
import os
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ckptd.core import checksum
from ckptd.core.errors import NotFound
from ckptd.core.increments import Ref, holder_of, refs_of


class Corrupt(Exception):
    """A shard failed its checksum (triggers ReportCorrupt and a retry)."""


class Gone(NotFound):
    """The step's own rank file is gone since the daemon named it (a retry asks again)."""


Holders = Mapping[int, str]
"""Where the daemon said each holder's files are (``RestoreResponse.holder_directories``):
a holder a later timeline replaced lies in its held copy, not beside the step."""


def holder_dir(
    directory: str, holder: int, part: bool = False, known: Holders | None = None
) -> str:
    """The directory of step ``holder``'s files: as the daemon said (``known``), else
    beside a step's ``directory`` (``part``: another node's part, one level deeper;
    see the module docstring)."""
    if known and holder in known:
        return known[holder]
    directory = os.path.normpath(directory)
    if part:
        above, node = os.path.split(directory)
        return os.path.join(os.path.dirname(above), str(holder), node)
    return os.path.join(os.path.dirname(directory), str(holder))


class Locator:
    """Each shard of one step's part (``directory``, its parsed ``manifest``): the
    file holding it and its offset there."""

    def __init__(
        self,
        directory: str,
        manifest: dict[str, Any],
        part: bool = False,
        holders: Holders | None = None,
    ) -> None:
        self.directory = directory
        self.step = int(manifest.get("step", 0))
        self.part = part
        self.holders = holders
        self._incremental: dict[int, tuple[list[list[int]], list[Ref]]] = {
            int(r["rank"]): (r["runs"], refs_of(r.get("refs")))
            for r in manifest.get("ranks", ())
            if r.get("runs") is not None
        }

    def locate(self, shard: dict[str, Any]) -> tuple[str, int]:
        """``(path, offset)`` of a shard row (core.shard_table.rows: its ``offset`` is
        in the rank's image)."""
        own = os.path.join(self.directory, shard["file"])
        inc = self._incremental.get(int(shard["rank"]))
        if inc is None:  # a full file: the image itself
            return own, int(shard["offset"])
        if not shard["length"]:  # an empty shard is in no run: nothing to read
            return own, 0
        runs, refs = inc
        try:
            step, offset = holder_of(runs, refs, self.step, shard["offset"], shard["length"])
        except ValueError as exc:  # the manifest was checked at commit: only a forged one
            raise Corrupt(f"shard {shard['key']!r} of {own}: {exc}") from None
        if step == self.step:
            return own, offset
        where = holder_dir(self.directory, step, self.part, self.holders)
        return os.path.join(where, shard["file"]), offset


class MappedImage:
    """A rank's image as views of the files that hold it: ``pieces`` are
    ``(image start, length, mapping, offset in the mapping)``, in image order, back
    to back from 0 to the image's end (:func:`map_image` builds them)."""

    def __init__(self, pieces: list[tuple[int, int, mmap.mmap, int]]) -> None:
        self.pieces = pieces
        self._starts = [p[0] for p in pieces]

    @classmethod
    def whole(cls, buf: mmap.mmap, base_offset: int = 0) -> MappedImage:
        """One buffer holding the image from ``base_offset`` on (a full rank's file,
        or a segment holding its data section)."""
        return cls([(base_offset, len(buf), buf, 0)])

    def at(self, start: int, length: int) -> tuple[mmap.mmap, int]:
        """The mapping holding image range ``[start, start + length)`` whole, and the
        range's offset in it."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or start + length > self.pieces[i][0] + self.pieces[i][1]:
            raise Corrupt(f"image range [{start}, {start + length}) lies in no one file")
        first, _, buf, offset = self.pieces[i]
        return buf, offset + start - first

    def bytes_at(self, start: int, length: int) -> np.ndarray:
        """Image range ``[start, start + length)`` as bytes, viewed where they lie."""
        buf, offset = self.at(start, length)
        return np.frombuffer(buf, np.uint8, length, offset)

    def crc32c(self) -> int:
        """crc32c of the whole image, piece by piece."""
        crc = 0
        for _, length, buf, offset in self.pieces:
            crc = checksum.extend(crc, np.frombuffer(buf, np.uint8, length, offset))
        return crc


def map_image(
    directory: str,
    record: dict[str, Any],
    opener: Callable[[str], int],
    part: bool = False,
    holders: Holders | None = None,
) -> MappedImage:
    """An incremental rank's image (``record``: its manifest record) as copy-on-write
    mappings of its own file and its holders'; the caller checks it against the
    image's crc32c (:func:`bad_reference` names a holder's range that differs).

    Nothing is copied: every shard lies whole in one reference or one run, so each
    array is a view of the file that holds it, as a full rank's arrays are of its
    one file (the page cache shared, pages copied only where the trainer writes).
    """
    own = os.path.join(directory, record["file"])
    refs = refs_of(record.get("refs"))
    paths = [
        os.path.join(holder_dir(directory, r.step, part, holders), record["file"]) for r in refs
    ]
    wanted: dict[str, int] = {}  # each holder's file: the end of its last range
    for path, ref in zip(paths, refs, strict=True):
        wanted[path] = max(wanted.get(path, 0), ref.offset + ref.length)
    maps = {path: map_file(opener, path, own, end) for path, end in wanted.items()}
    mine = map_file(opener, own, own, sum(int(n) for _, n in record["runs"]), record["size"])
    pieces = [(r.start, r.length, maps[p], r.offset) for p, r in zip(paths, refs, strict=True)]
    # A run is rounded out to whole blocks and may overlap a referenced shard (the
    # same bytes either way): the reference's piece is the one viewed, as locate() does.
    ends = [r.start + r.length for r in refs]
    pos = 0
    for start, length in ((int(a), int(b)) for a, b in record["runs"]):
        at, stop = start, start + length
        i = bisect.bisect_right(ends, start)  # the first reference ending inside the run
        while i < len(refs) and refs[i].start < stop:
            if refs[i].start > at:
                pieces.append((at, refs[i].start - at, mine, pos + at - start))
            at = max(at, ends[i])
            i += 1
        if at < stop:
            pieces.append((at, stop - at, mine, pos + at - start))
        pos += length
    pieces.sort(key=lambda p: p[0])
    end = 0
    for start, length, buf, offset in pieces:
        if start != end or length <= 0 or offset < 0:  # a forged manifest: commit checks them
            raise Corrupt(f"the runs and references of {own} do not hold image byte {end} once")
        end = start + length
        lo = offset - offset % mmap.PAGESIZE
        buf.madvise(mmap.MADV_WILLNEED, lo, offset + length - lo)  # readahead what is used
    if end != int(record["image_size"]):
        raise Corrupt(f"the runs and references of {own} end at image byte {end}")
    return MappedImage(pieces)


def bad_reference(
    image: MappedImage,
    directory: str,
    record: dict[str, Any],
    part: bool = False,
    holders: Holders | None = None,
) -> str | None:
    """The first referenced range of an image whose bytes differ from its crc32c, as
    an error naming the holder's file; None if every reference matches."""
    own = os.path.join(directory, record["file"])
    for ref in refs_of(record.get("refs")):
        crc = checksum.value(image.bytes_at(ref.start, ref.length))
        if crc != ref.crc32c:
            path = os.path.join(holder_dir(directory, ref.step, part, holders), record["file"])
            return (
                f"image range [{ref.start}, {ref.start + ref.length}) of {own}, held by "
                f"{path} (step {ref.step}), has crc32c {crc:#010x}, expected {ref.crc32c:#010x}"
            )
    return None


def map_file(
    opener: Callable[[str], int], path: str, own: str, need: int, size: int | None = None
) -> mmap.mmap:
    """``path`` mapped copy-on-write (:func:`map_held`): a step's own rank file
    (``path == own``; ``size``: its committed size) or a holder's of ``own``, which
    must reach byte ``need`` (a shorter or missing one: corrupt)."""
    fd = _open(opener, path, own)
    try:
        have = os.fstat(fd).st_size
        if size is not None and have != size:
            raise Corrupt(f"{path} is {have} bytes, expected {size}")
        if have < need or have == 0:
            raise Corrupt(f"{path} ends at byte {have}, before the ranges it holds")
    except BaseException:
        os.close(fd)
        raise
    return map_held(fd, have)


def map_held(fd: int, size: int, flags: int = mmap.MAP_PRIVATE) -> mmap.mmap:
    """Map ``fd`` (owned by the mapping from now on) read-write, holding a shared
    flock on it while mapped: the lock goes with the mapping (when the last array
    over it is gone) or with the process.

    The daemon honours the lock on what it lends and keeps: a segment is not
    reused while locked, and an evicted rank file that is locked is deleted
    instead of kept as a spare to write the next save into. A committed file is
    mapped private (the default): arrays over it are the caller's to update
    without touching the file, but pages not written yet still show the file, so
    it must not be overwritten under them (a deleted one stays readable).
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(mm, os.close, fd)
    return mm


def _open(opener: Callable[[str], int], path: str, own: str) -> int:
    """Open ``path``; a missing holder file makes the step unreadable here: corrupt.
    The step's own file missing is :class:`Gone`: removed since the daemon named it."""
    try:
        return opener(path)
    except (FileNotFoundError, NotFound):  # NotFound: the daemon's answer
        if path == own:
            raise Gone(
                f"{path} was removed after the daemon named it (the step left the local "
                "tier meanwhile: evicted, or replaced); restore again"
            ) from None
        raise Corrupt(f"{path}, which holds shards {own} references, is missing") from None
