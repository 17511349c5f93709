"""What the memory tier keeps (memory.py): each kept segment's image, the record
written beside it, and what is known of the process that wrote it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from .lease import Segment
from .liveness import process_start

__all__ = ["Image", "Kept", "live_writer"]


@dataclass(frozen=True)
class Image:
    """What a kept segment holds: one rank file of one committed step, its data
    section at offset 0 of the segment. Written beside the segment as its record."""

    job: str
    step: int
    rank: int
    timeline: int
    header_len: int
    header_crc: int
    data_len: int
    file_crc: int


@dataclass
class Kept:
    """A segment the tier keeps, and what is known of its bytes."""

    image: Image
    segment: Segment
    writer: tuple[int, int] | None
    """``(uid, pid)`` of the process that wrote it, while it may still write; None
    once it is gone (or unknown: then it is never lent)."""
    known_writer: bool
    started: int | None
    """The writer's start time (liveness.process_start), to tell it from a later
    process under its pid."""
    kept_at: float = field(default_factory=time.monotonic)
    quiet: bool = False
    """Checked intact after its writer was gone: nothing can have changed it since."""
    checking: asyncio.Future[bool] | None = None


def live_writer(who: Any) -> tuple[int, int] | None:
    """The ``(uid, pid)`` a record names, if that process still runs."""
    if not isinstance(who, list) or len(who) != 3:
        return None  # none named: unknown, never taken for gone
    uid, pid, started = (int(x) for x in who)
    return (uid, pid) if process_start(pid) == started else None
