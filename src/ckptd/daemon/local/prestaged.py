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

from ..catalog.roles import Steps
from .lease import Handed, Lease, Want
from .roles import Leases


class Prestaged:
    """Verified restore leases, one per ``(job, step, rank)``, each of the very file
    the step's manifest names: a save that replaced the step since (a new timeline
    under the same number) makes it stale, and it is never handed over."""

    name = "prestaged"

    def __init__(self, staging: Leases, catalog: Steps) -> None:
        self.staging = staging
        self.catalog = catalog
        self._leases: dict[tuple[str, int, int], tuple[Lease, tuple[int, int]]] = {}
        """Each lease, with what its file is: ``(timeline, crc32c)``."""

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

    def keep(self, job: str, step: int, rank: int, lease: Lease, holds: tuple[int, int]) -> None:
        """Keep ``lease``, holding ``rank``'s whole verified file of ``step``, for that
        rank's restore (an older one for the same rank goes back). ``holds``: the
        file's ``(timeline, crc32c)``, as its manifest records them."""
        old = self._leases.pop((job, step, rank), None)
        if old is not None:
            self.staging.release(old[0].lease_id)
        self._leases[(job, step, rank)] = (lease, holds)

    def release(self, lease: Lease) -> None:
        """Give back a lease that was not filled (a failed download or copy)."""
        self.staging.release(lease.lease_id)

    async def holds(self, job: str, step: int | None) -> list[tuple[bool, int, int]]:
        """No step of its own: every lease here is of a step the local tier holds."""
        return []

    async def bring(self, job: str, step: int, want: Want) -> Handed | None:
        """The lease kept for the rank wanted, if it is still granted and holds the file
        the step has now (taken once; a stale one goes back)."""
        kept = None if want.rank is None else self._leases.pop((job, step, want.rank), None)
        if kept is not None and kept[1] != self._file(job, step, want.rank):
            self.staging.release(kept[0].lease_id)  # the step was saved again since
            kept = None
        if kept is None or not self.staging.holds(kept[0]):
            raise NotFound(f"no lease holds rank {want.rank} of {job}/{step} in shared memory")
        return Handed(kept[0])

    def _file(self, job: str, step: int, rank: int | None) -> tuple[int, int] | None:
        """``(timeline, crc32c)`` of the step's file of ``rank`` as the catalog knows it."""
        st = self.catalog.get(job, step)
        if st is None or st.manifest is None:
            return None
        crc = next((r.crc32c for r in st.manifest.ranks if r.rank == rank), None)
        return None if crc is None else (st.timeline, crc)
