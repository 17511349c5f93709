"""Client side of restore: build arrays as views over the memory the daemon hands over.

Either a shared-memory segment the daemon filled and verified (preferred: no
page cache, no copy), or the rank's shard file mapped copy-on-write and checked
here against the manifest's crc32c. An incremental rank's file holds only part of
its image: it and its holders' files (rank_files.py) are mapped the same way, each
array a view of the file holding its shard, and the image checked piece by piece
against its crc32c.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ckptd.core import checksum
from ckptd.core.format import str_to_dtype
from ckptd.core.shard_table import table_of

from . import rank_files
from .rank_files import Corrupt as Corrupt  # raised here; callers catch it from here
from .rank_files import MappedImage
from .tree.spec import unflatten

SHM_DIR = "/dev/shm"


def rank_record(manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    """This rank's entry in the manifest."""
    return next(r for r in manifest["ranks"] if r["rank"] == rank)


def map_segment_locked(fd: int, size: int, private: bool = False) -> mmap.mmap:
    """Map a daemon segment (``fd``, handed over by the session; owned by the mapping
    from now on) read-write and hold a shared flock on it while mapped.

    The daemon lends the segment for as long as the lock is held: the lock is
    released when the mapping is garbage collected (every array viewing it is
    gone) or when this process dies, and only then may the daemon reuse it.
    ``private``: a segment the daemon keeps (its memory tier; ``fd`` read-only),
    mapped copy-on-write: the arrays share its pages until they are written, and
    what the trainer writes stays its own. Pages are mapped as they are first read,
    not here (populating a private mapping would copy every page).
    """
    flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return rank_files.map_held(fd, size, flags)


def map_file_verified(
    directory: str,
    manifest: dict[str, Any],
    rank: int,
    opener: Callable[[str], int],
    part: bool = False,
    holders: rank_files.Holders | None = None,
) -> mmap.mmap | MappedImage:
    """Map a rank file copy-on-write and check it against its crc32c (raises Corrupt);
    ``opener`` opens it read-only (the session hands over files this user may not).
    An incremental rank's image is mapped from its own file and its holders' beside
    ``directory`` (``part``: another node's part, see rank_files.py), or where the
    daemon said (``holders``)."""
    record = rank_record(manifest, rank)
    path = os.path.join(directory, record["file"])
    if record.get("runs") is not None:
        image = rank_files.map_image(directory, record, opener, part, holders)
        if image.crc32c() == record["image_crc32c"]:
            return image
        held_elsewhere = rank_files.bad_reference(image, directory, record, part, holders)
        if held_elsewhere:
            raise Corrupt(held_elsewhere)
    else:
        mm = _map_file(path, record, opener)
        # One pass over the whole image against its crc (header included); only a
        # mismatch is narrowed down to the shard that differs.
        if checksum.value(np.frombuffer(mm, np.uint8)) == record["crc32c"]:
            return mm
        image = MappedImage.whole(mm)
    t = table_of(manifest).of_rank(rank)
    for key, offset, length, expected in zip(
        t.keys, t.offset.tolist(), t.length.tolist(), t.crc32c.tolist(), strict=True
    ):
        crc = checksum.value(image.bytes_at(offset, length))
        if crc != expected:
            raise Corrupt(
                f"shard {key!r} in {path} has crc32c {crc:#010x}, expected {expected:#010x}"
            )
    raise Corrupt(f"the header of {path} differs from the one committed")


def _map_file(path: str, record: dict[str, Any], opener: Callable[[str], int]) -> mmap.mmap:
    """A full rank file mapped copy-on-write, its readahead started. No MAP_POPULATE:
    on a writable private mapping it would copy every page; the checksum pass faults
    pages in read-only, shared with the page cache."""
    mm = rank_files.map_file(opener, path, path, record["size"], record["size"])
    mm.madvise(mmap.MADV_WILLNEED)  # start readahead of the whole file now
    return mm


def build_tree(
    buf: mmap.mmap | MappedImage,
    manifest: dict[str, Any],
    rank: int,
    base_offset: int = 0,
    jax_leaf: Callable[[dict[str, Any], Any], Any] | None = None,
    target: Any = None,
    adopt: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Arrays as views into ``buf`` (a buffer holding the image from ``base_offset``
    on, or an incremental rank's mapped image), then the tree."""
    image = buf if isinstance(buf, MappedImage) else MappedImage.whole(buf, base_offset)
    arrays: dict[str, np.ndarray] = {}
    t = table_of(manifest).of_rank(rank)
    dtypes = {name: str_to_dtype(name) for name in set(t.dtypes)}
    for key, name, shape, start, length in zip(
        t.keys, t.dtypes, t.dims(t.shape), t.offset.tolist(), t.length.tolist(), strict=True
    ):
        if length == 0:
            arrays[key] = np.zeros(shape, dtypes[name])
        else:
            held, offset = image.at(start, length)
            arrays[key] = np.ndarray(shape, dtypes[name], buffer=held, offset=offset)
    if adopt is not None:
        adopt(arrays)  # jax leaves are assembled from these verified views
    tree = unflatten(rank_record(manifest, rank)["tree"], arrays, jax_leaf, target)
    return tree, manifest.get("metadata") or {}
