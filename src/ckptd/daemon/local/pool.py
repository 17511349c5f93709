"""The segment files of a staging pool: made, found and removed in the daemon's
own directory (segments.py says why there and what is trusted)."""

from __future__ import annotations

import itertools
import logging
import os
import secrets
from pathlib import Path

from .lease import Segment
from .segments import create_segment, prepare_dir, segment_dir
from .shm import can_populate

log = logging.getLogger("ckptd.staging")


class SegmentPool:
    """Segments by name, in ``<shm_dir>/<prefix>.d``; the base of staging.Staging."""

    def __init__(self, prefix: str, shm_dir: Path) -> None:
        self.prefix = prefix
        self.shm_dir = shm_dir
        """Where clients' liveness files are (liveness.py), and an older daemon's segments."""
        self.dir = segment_dir(prefix, shm_dir)
        """The daemon's own directory of segments."""
        self._dir_ready = False
        self._segments: dict[str, Segment] = {}
        self._reserved = 0  # bytes being allocated right now, not yet in _segments
        self._counter = itertools.count()

    @property
    def allocated_bytes(self) -> int:
        """Shared memory held in segments (free or leased)."""
        return sum(s.size for s in self._segments.values()) + self._reserved

    def open(self) -> None:
        """Create (or check) the segment directory; FailedPrecondition if it is not ours."""
        if not self._dir_ready:
            prepare_dir(self.dir)
            self._dir_ready = True

    def path_of(self, seg: Segment) -> Path:
        """Where ``seg``'s file is."""
        return self.dir / seg.name

    def _create(self, size: int, populate: bool = True) -> Segment:
        self.open()
        name = f"{self.prefix}{next(self._counter)}-{secrets.token_hex(4)}"
        if not populate:  # only where the pages can be had later without a SIGBUS
            st = os.statvfs(self.dir)
            populate = not can_populate() or st.f_bavail * st.f_frsize < 2 * size
        mapping = create_segment(self.dir / name, size, populate)
        log.info("allocated staging segment %s (%d bytes)", name, size)
        return Segment(name, size, mapping, populated=populate)

    def _destroy(self, seg: Segment) -> None:
        self._segments.pop(seg.name, None)
        (self.dir / seg.name).unlink(missing_ok=True)
        if not seg.mapping.close():
            # A thread still reads or writes through a view (a failed transfer being
            # wound down): unmapping now would crash it, so the pages go at exit.
            log.warning("segment %s is still in use; it is unmapped at exit", seg.name)
