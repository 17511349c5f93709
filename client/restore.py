"""Client side of restore: build arrays as views over the memory the daemon hands over.

Either a shared-memory segment the daemon filled and verified (preferred: no
page cache, no copy), or the rank's shard file mapped copy-on-write and checked
here against the manifest's crc32c.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ckptd.core import checksum
from ckptd.core.format import str_to_dtype

from .tree import unflatten

SHM_DIR = "/dev/shm"


class Corrupt(Exception):
    """A shard failed its checksum (triggers ReportCorrupt and a retry)."""


def rank_record(manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    """This rank's entry in the manifest."""
    return next(r for r in manifest["ranks"] if r["rank"] == rank)


def map_segment_locked(fd: int, size: int) -> mmap.mmap:
    """Map a daemon segment (``fd``, handed over by the session; owned by the mapping
    from now on) read-write and hold a shared flock on it while mapped.

    The daemon lends the segment for as long as the lock is held: the lock is
    released when the mapping is garbage collected (every array viewing it is
    gone) or when this process dies, and only then may the daemon reuse it.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(mm, os.close, fd)
    return mm


def map_file_verified(
    directory: str, manifest: dict[str, Any], rank: int, opener: Callable[[str], int]
) -> mmap.mmap:
    """Map a rank file copy-on-write and check every shard's crc32c (raises Corrupt);
    ``opener`` opens it read-only (the session hands over files this user may not)."""
    record = rank_record(manifest, rank)
    path = os.path.join(directory, record["file"])
    with os.fdopen(opener(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != record["size"]:
            raise Corrupt(f"{path} is {size} bytes, expected {record['size']}")
        # Private + writable: the views are copy-on-write, so callers may update
        # restored state in place without touching the committed file. No
        # MAP_POPULATE: on a writable private mapping it would copy every page; the
        # checksum pass below faults pages in read-only, shared with the page cache.
        mm = mmap.mmap(
            f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    mm.madvise(mmap.MADV_WILLNEED)  # start readahead of the whole file now
    shards = [s for s in manifest["shards"] if s["rank"] == rank]
    crcs = checksum.of_ranges(
        np.frombuffer(mm, np.uint8), [(s["offset"], s["length"]) for s in shards]
    )
    for s, crc in zip(shards, crcs, strict=True):
        if crc != s["crc32c"]:
            raise Corrupt(
                f"shard {s['key']!r} in {path} has crc32c {crc:#010x}, expected {s['crc32c']:#010x}"
            )
    return mm


def build_tree(
    buf: mmap.mmap,
    manifest: dict[str, Any],
    rank: int,
    base_offset: int = 0,
    jax_leaf: Callable[[dict[str, Any], Any], Any] | None = None,
    target: Any = None,
    adopt: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Arrays as views into ``buf`` (shard offsets shifted by ``base_offset``), then the tree."""
    arrays: dict[str, np.ndarray] = {}
    for s in manifest["shards"]:
        if s["rank"] != rank:
            continue
        dt = str_to_dtype(s["dtype"])
        if math.prod(s["shape"]) == 0:
            arrays[s["key"]] = np.zeros(s["shape"], dt)
        else:
            arrays[s["key"]] = np.ndarray(
                s["shape"], dt, buffer=buf, offset=s["offset"] - base_offset
            )
    if adopt is not None:
        adopt(arrays)  # jax leaves are assembled from these verified views
    tree = unflatten(rank_record(manifest, rank)["tree"], arrays, jax_leaf, target)
    return tree, manifest.get("metadata") or {}
