"""This node's copies in the bucket of saves a later save replaced under their number,
taken out when no upload will take them out.

A save under a number held before replaces that step in every tier. Its upload
would take this node's older copy under the number out of the bucket
(remote/publish.py), but the save may leave before it goes up (superseded,
evicted), or the node may be lost first, and then the older copy would come back as
the step. So once the replacing save is committed, the drain takes the older copy
out between its uploads, without waiting for the upload: a copy the catalog
recorded as replaced (``Catalog.replaced_numbers``) unless the save under its number
is still being written (it may fail and give the number back), and a copy of a
save a later timeline began with when no step is known under its number here. It
runs in the drain, the one writer of this node's copies under a number: no upload
under that number runs meanwhile, so the keys it deletes, which name the number and
the node but not the timeline, are the older copy's.

Removals cut short (a crash, or the bucket away, after an entry was flagged
``retracting``: remote/retract.py) are finished here too, for the same reason; not
one whose number a save on its way up took (its upload replaces the entry).
"""

from __future__ import annotations

import asyncio
import logging
import time

from ckptd.core.timeline import Forks, replaced
from ckptd.proto import ckptd_pb2 as pb

from ..catalog import Catalog
from ..remote import held, retract
from ..remote.base import Remote
from ..remote.index import Entry, NodeIndex

log = logging.getLogger("ckptd.drain")

RETRY_SECONDS = 30.0
"""A job whose retract failed (the bucket away) is tried again after this long."""


class ReplacedCopies:
    """Takes replaced saves' copies out of the bucket (see the module doc)."""

    def __init__(
        self, catalog: Catalog, remote: Remote, index: NodeIndex, stall_seconds: float = 45.0
    ) -> None:
        self.catalog, self.remote, self.index = catalog, remote, index
        self.stall_seconds = stall_seconds
        """Longest one job's pass waits on the bucket: a store that hangs never raises,
        and the drain's uploads (which report the stall) must not wait behind it."""
        self._failed_at: dict[str, float] = {}
        self.finished = 0
        """Removals cut short that this drain finished (counted as remote evictions)."""

    async def run(self) -> None:
        """One pass over the jobs that may have such copies: those with a number a
        later save took, or a later timeline; then the removals cut short."""
        await self._finish_cut_short()
        for job in self.catalog.jobs():
            later = self.catalog.replaced_numbers(job)
            lineage = self.catalog.lineage(job)
            if not later and not lineage:
                continue
            if time.monotonic() - self._failed_at.get(job, -RETRY_SECONDS) < RETRY_SECONDS:
                continue
            try:
                await asyncio.wait_for(self._job(job, later, lineage), self.stall_seconds)
            except Exception as exc:  # the bucket away or hung: the next pass tries again
                self._failed_at[job] = time.monotonic()
                log.warning("could not retract replaced copies of %s from %s: %s", job,
                            self.remote.url, self._why(exc))  # fmt: skip
            else:
                self._failed_at.pop(job, None)

    async def _job(self, job: str, later: dict[int, int], lineage: Forks) -> None:
        entries = await self.index.entries(job)
        for n, timeline in later.items():
            if (e := entries.get(n)) is None or e.timeline >= timeline:
                self.catalog.retracted(job, n, timeline)  # uploaded over, or none there
        stale = [e for e in entries.values() if self.stale(job, e, lineage, later)]
        if not stale:
            return
        read = held.read_in_bucket(entries) | self.catalog.read_copies(job)
        for e in stale:
            if not self.stale(job, e, self.catalog.lineage(job), later):
                continue  # a save under its number came meanwhile: its upload decides
            log.info(
                "%s/%d: retracting this node's copy of timeline %d from %s: a later save "
                "under its number replaced it",
                job,
                e.step,
                e.timeline,
                self.remote.url,
            )
            await held.take_out(self.remote, self.index, job, self.catalog.node_id, e, read)
            if e.step in later:
                self.catalog.retracted(job, e.step, later[e.step])

    def stale(self, job: str, e: Entry, lineage: Forks, later: dict[int, int]) -> bool:
        """Whether ``e``, this node's copy in the bucket, is of a save a later one
        replaced: a later timeline began with a save under its number and no step
        under it is here, or a later save under it was recorded and is not still
        being written."""
        st = self.catalog.get(job, e.step)
        if st is None and replaced(e.timeline, e.step, lineage):
            return True
        if e.step not in later or e.timeline >= later[e.step]:
            return False
        return st is None or st.state != pb.SAVE_STATE_STAGING

    async def _finish_cut_short(self) -> None:
        for job, entry in self.index.cut_short():
            st = self.catalog.get(job, entry.step)
            if st is not None and st.state in _ON_ITS_WAY:
                continue
            if time.monotonic() - self._failed_at.get(job, -RETRY_SECONDS) < RETRY_SECONDS:
                continue
            node = self.catalog.node_id
            try:
                await asyncio.wait_for(
                    retract.finish(self.remote, self.index, job, entry, node), self.stall_seconds
                )
            except Exception as exc:  # the bucket away or hung: the next pass tries again
                self._failed_at[job] = time.monotonic()
                log.warning("could not finish removing %s/%d from %s: %s", job, entry.step,
                            self.remote.url, self._why(exc))  # fmt: skip
                continue
            self.finished += 1
            log.info("%s/%d: finished its removal from %s", job, entry.step, self.remote.url)

    def _why(self, exc: Exception) -> str:
        """What failed, in words (a wait that ran out says nothing itself); a removal
        cut short by it is finished by a later pass (remote/retract.py)."""
        if isinstance(exc, TimeoutError):
            return f"no answer within {self.stall_seconds:.0f} s: the store is not answering"
        return str(exc)


_ON_ITS_WAY = frozenset({pb.SAVE_STATE_STAGING, pb.SAVE_STATE_LOCAL, pb.SAVE_STATE_DRAINING})
"""A save in these states under a number goes up and takes the number's entry."""
