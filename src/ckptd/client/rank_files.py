"""Where a rank's bytes are on disk: its own file, or an older step's (incremental saves).

A full rank file is the rank's *image* (the header, then every shard; the manifest's
shard offsets are offsets in it). An incremental one holds only some image ranges
(its ``runs``); every other shard is a reference to the same rank's file of an older
step of the job, its *holder* (core/increments.py). The holder's files lie beside
the step's: the local tier keeps ``<root>/<job>/<step>/``, so a holder is the
sibling ``<root>/<job>/<holder>/``; another node's part fetched for a restore lies
in ``<peers>/<job>/<step>/<node>/``, so its holder is ``<peers>/<job>/<holder>/<node>/``.
The daemon grants a restore's holder directories with the step's own.

Readers that take a shard at a time (:class:`~ckptd.client.jax_arrays.ShardReader`)
ask :class:`Locator` for its file and offset; a whole-rank restore from files
(:func:`read_image`) reads the image into memory of its own and checks its crc32c.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ckptd.core import checksum
from ckptd.core.errors import NotFound
from ckptd.core.increments import Ref, holder_of, refs_of


class Corrupt(Exception):
    """A shard failed its checksum (triggers ReportCorrupt and a retry)."""


def holder_dir(directory: str, holder: int, part: bool = False) -> str:
    """The directory of step ``holder``'s files beside a step's ``directory``
    (``part``: another node's part, one level deeper; see the module docstring)."""
    directory = os.path.normpath(directory)
    if part:
        above, node = os.path.split(directory)
        return os.path.join(os.path.dirname(above), str(holder), node)
    return os.path.join(os.path.dirname(directory), str(holder))


class Locator:
    """Each shard of one step's part (``directory``, its parsed ``manifest``): the
    file holding it and its offset there."""

    def __init__(self, directory: str, manifest: dict[str, Any], part: bool = False) -> None:
        self.directory = directory
        self.step = int(manifest.get("step", 0))
        self.part = part
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
        return os.path.join(holder_dir(self.directory, step, self.part), shard["file"]), offset


def read_image(
    directory: str, record: dict[str, Any], opener: Callable[[str], int], part: bool = False
) -> mmap.mmap:
    """An incremental rank's image (``record``: its manifest record), read into
    private memory from its own file and its holders'; the caller checks it against
    the image's crc32c (:func:`bad_reference` names a holder's range that differs).

    The image is assembled rather than mapped: its ranges lie in several files, and
    the arrays built over it must be one buffer at the image's offsets. Private
    anonymous memory is what a restore into a segment hands over too; the restored
    arrays are the caller's to update, as over a copy-on-write mapping.
    """
    own = os.path.join(directory, record["file"])
    image = mmap.mmap(-1, int(record["image_size"]), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        for path, pieces in _pieces(directory, record, part):
            fd = _open(opener, path, own)
            try:
                size = os.fstat(fd).st_size
                if path == own and size != record["size"]:
                    raise Corrupt(f"{path} is {size} bytes, expected {record['size']}")
                for start, length, offset in pieces:
                    _read_into(fd, image, start, length, offset, path)
            finally:
                os.close(fd)
    except BaseException:
        image.close()
        raise
    return image


def bad_reference(
    image: np.ndarray, directory: str, record: dict[str, Any], part: bool = False
) -> str | None:
    """The first referenced range of an image whose bytes differ from its crc32c, as
    an error naming the holder's file; None if every reference matches."""
    own = os.path.join(directory, record["file"])
    for ref in refs_of(record.get("refs")):
        crc = checksum.value(image[ref.start : ref.start + ref.length])
        if crc != ref.crc32c:
            path = os.path.join(holder_dir(directory, ref.step, part), record["file"])
            return (
                f"image range [{ref.start}, {ref.start + ref.length}) of {own}, held by "
                f"{path} (step {ref.step}), has crc32c {crc:#010x}, expected {ref.crc32c:#010x}"
            )
    return None


def _pieces(
    directory: str, record: dict[str, Any], part: bool
) -> Iterator[tuple[str, list[tuple[int, int, int]]]]:
    """Each file to read and its ``(image start, length, file offset)`` ranges: the
    holders' first, then the file's own runs (a run rounded out to whole blocks may
    overlap a referenced shard; both hold the same bytes)."""
    by_file: dict[str, list[tuple[int, int, int]]] = {}
    for ref in refs_of(record.get("refs")):
        path = os.path.join(holder_dir(directory, ref.step, part), record["file"])
        by_file.setdefault(path, []).append((ref.start, ref.length, ref.offset))
    yield from by_file.items()
    runs, pos = [], 0
    for start, length in record["runs"]:
        runs.append((int(start), int(length), pos))
        pos += int(length)
    yield os.path.join(directory, record["file"]), runs


def _open(opener: Callable[[str], int], path: str, own: str) -> int:
    """Open ``path``; a missing holder file makes the step unreadable here: corrupt."""
    try:
        return opener(path)
    except (FileNotFoundError, NotFound):  # NotFound: the daemon's answer
        if path == own:
            raise
        raise Corrupt(f"{path}, which holds shards {own} references, is missing") from None


def _read_into(fd: int, image: mmap.mmap, start: int, length: int, offset: int, path: str) -> None:
    """Fill ``image[start:start + length]`` from ``fd`` at ``offset`` (a file shorter
    than that: corrupt). Each view is released before anything is raised: a view
    kept alive by a traceback would keep the image from being closed."""
    done = 0
    while done < length:
        with memoryview(image)[start + done : start + length] as dest:
            n = os.preadv(fd, [dest], offset + done)
        if n <= 0:
            raise Corrupt(f"{path} ends at byte {offset + done}, before the range it holds")
        done += n
