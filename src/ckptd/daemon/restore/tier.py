"""What every tier answers a restore: the one interface the chooser (chooser.py) asks.

A tier is a place a verified copy of a step can come from: shared memory (the
memory tier's kept copies of recent saves: local/memory.py; leases pre-staged for
a rank by a download: local/prestaged.py), the local disk (local/source.py),
the peers' replicas (peer/source.py) and the bucket (remote/source.py). Each
answers two questions and nothing else: which verified steps of a job it holds,
and "bring me this one", into the local tier (every copy is committed there
before it is served) or as a lease whose memory already holds the rank's
verified data. A new tier implements these two methods and is listed where the
composition root builds the chooser (app/compose.py); the restore path does not
change. The tiers implement the protocol by its shape: none imports this
package, which sits above them.
"""

from __future__ import annotations

from typing import Protocol

from ..local.lease import Handed, Want

Order = tuple[bool, int, int]
"""A step's place in its job's history, newest last: ``Step.order`` (catalog/step.py),
``(live, timeline, step)``."""


class Tier(Protocol):
    """One tier, as a restore sees it."""

    @property
    def name(self) -> str:
        """The tier a copy came from, for the restore metrics and the logs: "memory",
        "prestaged", "local", "peer", "remote"."""
        ...

    async def holds(self, job: str, step: int | None) -> list[Order]:
        """The steps of ``job`` (only ``step``, when given) this tier holds a verified
        copy of, newest first. A tier may answer with nothing when asking costs more
        than the answer is worth (the peers, while the local tier has the step)."""
        ...

    async def bring(self, job: str, step: int, want: Want) -> Handed | None:
        """Bring ``step`` into the local tier, or hand a lease holding the wanted
        rank's verified data (:class:`Want`): None when the step is in the local
        tier now.

        Raises :class:`~ckptd.core.errors.NotFound` when this tier holds no copy of
        it, :class:`~ckptd.core.errors.Unavailable` when it could not give it now,
        and :class:`~ckptd.core.errors.DataLoss` when its copy does not verify (the
        tier has recorded that in the catalog): the chooser asks the next holder.
        """
        ...
