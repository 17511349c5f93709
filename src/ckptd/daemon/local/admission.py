"""Admission: may a new save start now? Staging memory and local disk space.

Separate from retention: admission only reads the free space and the staging
pool, and when a save would take the disk below its floor it asks for one
local-only eviction pass (no bucket I/O inside an RPC) before refusing with a
RESOURCE_EXHAUSTED error that says how much is short and what to change. The
free-space reading is injectable so tests decide what the disk holds.
"""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from ckptd.core.errors import ResourceExhausted

from .roles import Budget
from .store import LocalStore

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(value: object) -> int:
    """Parse ``1073741824``, ``"1GiB"``, ``"512 MiB"`` or ``"1.5GB"`` into bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size, got a boolean")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"expected a size such as 4294967296 or '4GiB', got {value!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class SpaceMark:
    """A free-space mark: a size ('20GiB', '0') or a percentage of the disk ('10%')."""

    text: str
    size: int = 0
    percent: float | None = None

    @classmethod
    def parse(cls, value: object) -> SpaceMark:
        """Parse a mark; raises ValueError saying what is accepted."""
        text = str(value).strip()
        if text.endswith("%"):
            try:
                pct = float(text[:-1])
            except ValueError:
                pct = -1.0
            if not 0 <= pct <= 100:
                raise ValueError(f"expected a percentage between 0% and 100%, got {value!r}")
            return cls(text, percent=pct)
        try:
            return cls(text, size=parse_size(text))
        except ValueError:
            raise ValueError(
                f"expected a size such as '20GiB' or a percentage such as '10%', got {value!r}"
            ) from None

    def bytes(self, disk_bytes: int) -> int:
        """The mark in bytes on a disk of ``disk_bytes``."""
        return int(disk_bytes * self.percent / 100) if self.percent is not None else self.size

    def __str__(self) -> str:
        return self.text


def gib(n: int) -> str:
    """Bytes as GiB with two decimals, for messages."""
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class Space:
    """Free and total bytes of the local tier's filesystem."""

    free: int
    total: int


def statvfs_space(root: Path) -> Space:
    """The filesystem's own figures (what is left for an unprivileged writer)."""
    st = os.statvfs(root)
    return Space(st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)


class DiskSpace:
    """Free space of the local tier and its two marks (low watermark, floor)."""

    def __init__(
        self,
        root: Path,
        low_watermark: SpaceMark,
        floor: SpaceMark,
        measure: Callable[[Path], Space] = statvfs_space,
    ) -> None:
        self.root = root
        self.low_watermark = low_watermark
        self.floor = floor
        self._measure = measure

    def space(self) -> Space:
        """Free and total bytes now."""
        return self._measure(self.root)

    def marks(self, space: Space | None = None) -> tuple[int, int]:
        """(low watermark, floor) in bytes."""
        total = (space or self.space()).total
        return self.low_watermark.bytes(total), self.floor.bytes(total)


class Admission:
    """Decides whether a save may start: staging memory and disk space above the floor."""

    def __init__(
        self,
        disk: DiskSpace,
        staging: Budget,
        store: LocalStore,
        run_io: Callable[..., Awaitable[object]],
        retention_hint: str,
        relieve: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.disk = disk
        self.staging = staging
        self.store = store
        self._run_io = run_io
        self.retention_hint = retention_hint
        """The local retention as configured, named in the refusal."""
        self.relieve = relieve
        """A local-only eviction pass (the evictor's), run before a save is refused."""

    def _disk_need(self, size_bytes: int) -> tuple[Space, int, int, int]:
        """(space, floor, bytes of saves still being written, free bytes a save needs)."""
        space = self.disk.space()
        _, floor = self.disk.marks(space)
        writing = self.staging.committed_bytes
        return space, floor, writing, size_bytes + writing + floor

    async def check_space(self, size_bytes: int) -> None:
        """Refuse a save that would take the local disk below the floor.

        Counts the bytes of saves still being written. If the floor would be
        crossed, frees spare files, then runs one local eviction pass and frees
        the spares that pass made of the files it evicted.
        """
        space, floor, writing, need = self._disk_need(size_bytes)
        if space.free < need:
            # Spares first: giving them back costs no checkpoint.
            await self._run_io(self.store.drop_spares)
            space, floor, writing, need = self._disk_need(size_bytes)
        if space.free < need and self.relieve is not None:
            await self.relieve()
            # The pass keeps the files it evicts as spares for later saves, but the
            # space is wanted now: dropped before this save, else it is refused
            # while the bytes it waits for sit in .spare.
            await self._run_io(self.store.drop_spares)
            space, floor, writing, need = self._disk_need(size_bytes)
        if space.free >= need:
            return
        raise ResourceExhausted(
            f"local tier {self.disk.root} has {gib(space.free)} free; this save "
            f"needs {gib(size_bytes)} plus {gib(writing)} for saves being written, and "
            f"{gib(floor)} must stay free (local_floor = {str(self.disk.floor)!r}): "
            f"{gib(need - space.free)} short. Free disk space, keep fewer checkpoints "
            f"(retention_local = {self.retention_hint!r}) or lower local_floor"
        )

    def capacity_reason(self, size_bytes: int) -> str:
        """Why a save of ``size_bytes`` could not start right now ("" if it could)."""
        if not self.staging.could_grant(size_bytes):
            return (
                f"staging memory is held by in-flight saves ({self.staging.in_use_bytes} of "
                f"{self.staging.budget_bytes} bytes)"
            )
        space, floor, _, need = self._disk_need(size_bytes)
        if space.free < need:
            return f"local disk has {gib(space.free)} free; the floor is {gib(floor)}"
        return ""
