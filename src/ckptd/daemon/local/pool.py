"""The segment files of a staging pool: made, found and removed in the daemon's
own directory (segments.py says where that is and what is trusted)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
from pathlib import Path

from .lease import Segment
from .segment_state import SegState, move
from .segments import claim_dir, create_segment, legacy_dir
from .shm import SharedMapping, can_populate

log = logging.getLogger("ckptd.staging")


class SegmentPool:
    """Segments by name, in the daemon's directory under ``shm_dir``; the base of
    staging.Staging."""

    def __init__(self, prefix: str, shm_dir: Path, record: Path | None = None) -> None:
        self.prefix = prefix
        self.shm_dir = shm_dir
        """Where clients' liveness files are (liveness.py), and an older daemon's segments."""
        self.record = record
        """The root's file naming the segment directory (segments.py); None: not recorded
        (a pool a tool or test makes for itself)."""
        self._dir: Path | None = None
        self._segments: dict[str, Segment] = {}
        self._reserved = 0  # bytes being allocated right now, not yet in _segments
        self._unmapping: list[SharedMapping] = []  # unlinked, a view still alive
        self._counter = itertools.count()

    @property
    def dir(self) -> Path:
        """The daemon's own directory of segments (known once :meth:`open` ran)."""
        if self._dir is None:
            raise RuntimeError("the staging pool's directory is not open yet")
        return self._dir

    @property
    def allocated_bytes(self) -> int:
        """Shared memory held in segments (free or leased), being made, or unlinked and
        still mapped by the daemon (a view of it is alive: unmapped once it is not)."""
        held = sum(s.size for s in self._segments.values()) + self._reserved
        return held + sum(m.size for m in self._unmapping)

    def open(self) -> None:
        """Find or make the segment directory (segments.py: the recorded one if it is the
        daemon's, else a new one, recorded); OSError if none can be had."""
        if self._dir is None:
            self._dir = claim_dir(self.shm_dir, self.record, legacy_dir(self.prefix, self.shm_dir))

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

    def _destroy(self, seg: Segment, why: str = "removed") -> None:
        if seg.state is SegState.GONE:
            return  # removed already (a stop after it went, say): nothing is left to drop
        move(seg, SegState.GONE, why)
        self._segments.pop(seg.name, None)
        (self.dir / seg.name).unlink(missing_ok=True)
        if not seg.mapping.close():
            # A thread still reads or writes through a view (a failed transfer being
            # wound down): unmapping now would crash it. The pages stay counted until
            # the view is gone and the mapping is unmapped (:meth:`_unmap_later`).
            log.info("segment %s is still in use; it is unmapped once it is not", seg.name)
            self._unmapping.append(seg.mapping)

    def _unmap_later(self) -> None:
        """Unmap the removed segments whose last view is gone."""
        self._unmapping = [m for m in self._unmapping if not m.close()]

    def _remove_all(self) -> None:
        """Unlink every segment and every other name in the directory, then the
        directory: a clean stop gives the node its memory back (a process that still
        maps a segment keeps its pages until it unmaps them)."""
        for seg in list(self._segments.values()):
            self._destroy(seg)
        self._unmap_later()
        if self._dir is None:
            return
        with contextlib.suppress(FileNotFoundError):
            for path in self._dir.iterdir():
                with contextlib.suppress(IsADirectoryError, PermissionError, FileNotFoundError):
                    path.unlink()
        with contextlib.suppress(OSError):  # never made, or something we may not remove
            self._dir.rmdir()
