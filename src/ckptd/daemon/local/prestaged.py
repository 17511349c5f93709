"""Rank files waiting in shared memory for their rank's restore: pre-staged copies
(not the memory tier, memory.py, which keeps what saves committed).

A download from the bucket fills a restore lease for every rank of the node
(ranks' Restore calls usually arrive together), and the peer tier copies a
step it took back into leases after committing it. Each lease holds a rank
file whole and verified; the rank's restore hands it over instead of reading
the disk. One nobody claims expires like any lease a client never used.
"""

from __future__ import annotations

from ckptd.core.errors import NotFound, ResourceExhausted, Unavailable
from ckptd.core.format import round_up

from .lease import Handed, Lease, Want
from .staging import Staging


class Prestaged:
    """Verified restore leases, one per ``(job, step, rank)``."""

    name = "prestaged"

    def __init__(self, staging: Staging) -> None:
        self.staging = staging
        self._leases: dict[tuple[str, int, int], Lease] = {}

    async def lease_for(self, job: str, size: int) -> Lease | None:
        """A segment to fill with a file of ``size`` bytes: a free one, else a new one
        if the budget has room for it and for a save of the same size after it (the
        client may keep it); None: the file stays on disk only."""
        lease = self.staging.take_free(job, round_up(size))
        budget = self.staging.budget_bytes
        if lease is None and self.staging.allocated_bytes + 2 * round_up(size) <= budget:
            try:
                # Its pages are allocated as the bytes arrive, so the first parts of a
                # download need not wait for the whole segment (fresh memory is slow).
                lease = await self.staging.acquire(
                    job, round_up(size), restore=True, populate=False
                )
            except (ResourceExhausted, Unavailable):  # no room, or the daemon is stopping
                return None
        return lease

    def keep(self, job: str, step: int, rank: int, lease: Lease) -> None:
        """Keep ``lease``, holding ``rank``'s whole verified file of ``step``, for that
        rank's restore (an older one for the same rank goes back)."""
        old = self._leases.pop((job, step, rank), None)
        if old is not None:
            self.staging.release(old.lease_id)
        self._leases[(job, step, rank)] = lease

    def release(self, lease: Lease) -> None:
        """Give back a lease that was not filled (a failed download or copy)."""
        self.staging.release(lease.lease_id)

    async def holds(self, job: str, step: int | None) -> list[tuple[bool, int, int]]:
        """No step of its own: every lease here is of a step the local tier holds."""
        return []

    async def bring(self, job: str, step: int, want: Want) -> Handed | None:
        """The lease kept for the rank wanted, if it is still granted (taken once)."""
        lease = None if want.rank is None else self._leases.pop((job, step, want.rank), None)
        if lease is None or not self.staging.holds(lease):
            raise NotFound(f"no lease holds rank {want.rank} of {job}/{step} in shared memory")
        return Handed(lease)
