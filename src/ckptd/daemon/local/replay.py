"""The journal's replay: finish the handoffs a crashed daemon acknowledged.

Each live commit record names the segment holding the save's bytes. A segment
that survived (the daemon died, the host did not) is adopted and the save
written as if it had just arrived. A file under that name that the daemon did
not make (segments.py) is refused and never mapped: mapping it would restore
another user's bytes, or put the next save into their mapping.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ckptd.core.errors import CkptdError
from ckptd.core.timeline import Forks

from .. import faults
from .journal import Entry, Journal
from .pending import CommitRequest
from .roles import Leases
from .segments import SegmentRefused

Commit = Callable[[CommitRequest, bytes | None, tuple[int, Forks] | None], Awaitable[int]]
"""``Saver.commit``: taken as a callable so the replay sits beneath the saver."""

log = logging.getLogger("ckptd.node")


def _step_of(entry: Entry, parse: Callable[[bytes], CommitRequest]) -> str:
    """The step a record's request names, for log lines ("?" if it does not parse)."""
    try:
        return str(parse(entry.body).step)
    except Exception:  # a record too damaged to name its step is still reported
        return "?"


async def replay(
    staging: Leases,
    journal: Journal,
    commit: Commit,
    entries: list[Entry],
    parse: Callable[[bytes], CommitRequest],
) -> int:
    """Adopt each record's segment and commit its save; returns how many were replayed."""
    replayed = 0
    for entry in entries:
        if faults.armed("journal.replay"):  # tests hold the start-up here (its probes answer)
            await asyncio.to_thread(faults.hit, "journal.replay")
        try:
            staging.adopt(entry.segment, entry.lease_id, entry.job, entry.size)
        except (OSError, ValueError) as exc:
            refused = isinstance(exc, SegmentRefused)
            log.error(
                "journal: an acknowledged save of job %s step %s is lost: its shared memory "
                "%s %s (%s)",
                entry.job,
                _step_of(entry, parse),
                staging.dir / entry.segment,
                "was refused, not adopted" if refused else "is gone",
                f"{exc}; find out who made that file"
                if refused
                else f"{exc}; shared memory does not survive a reboot",
            )
            await journal.done([entry.lease_id])
            continue
        try:
            await commit(parse(entry.body), None, entry.timeline)
            replayed += 1
            log.info("journal: replayed the handoff of lease %s", entry.lease_id)
        except CkptdError as exc:
            log.info("journal: record of lease %s needs nothing: %s", entry.lease_id, exc)
            await journal.done([entry.lease_id])
            staging.release(entry.lease_id)
    return replayed
