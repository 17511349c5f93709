"""The restore's one decision: which tier gives which step.

Every tier answers the same two questions (tier.py): which verified steps of a
job it holds, and "bring me this one". The chooser asks them, fastest first
(shared memory, the local disk, the peers, the bucket), and:

- takes the newest step: a step only a tier outside the catalog holds (a peer's
  replica of a node that lost its disk) and that is newer than every copy the
  catalog knows is brought into the local tier first (:meth:`Chooser.learn`);
- serves the chosen step from its fastest holder. A tier that does not hold it,
  cannot give it now, or whose copy does not verify, passes it to the next; a
  step brought into the local tier is then served from there (its shared memory
  first), as every copy is;
- when no tier could give the step and what the catalog knows of it changed (a
  corrupt copy set aside, the bucket's marked unusable, the local copy evicted
  under it), chooses again: the next newest step, unless that step was asked
  for (its DataLoss is the answer).

Which steps count (healthy, adopted, the step asked for, its errors) is the
restorer's choice, passed in as ``pick``: the catalog's steps filtered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ckptd.core.errors import CkptdError, DataLoss, NotFound, Unavailable

from ..catalog import Step
from ..catalog.roles import Steps
from ..local.lease import Handed, Want
from .tier import Order, Tier

log = logging.getLogger("ckptd.restore")

PASSED = (NotFound, Unavailable, DataLoss)
"""What a tier raises to pass a step to the next holder (tier.py)."""


@dataclass(frozen=True)
class Served:
    """A chosen step, in the local tier, and the lease holding the rank's data if any."""

    step: Step
    handed: Handed | None
    tier: str
    """The tier the copy came from: the one that brought it into the local tier,
    else the one that served it ("memory", "local")."""


class Chooser:
    """Picks the fastest holder of the newest verified step; falls back in order."""

    def __init__(self, catalog: Steps, tiers: Sequence[Tier], local: Tier) -> None:
        if local not in tiers:
            raise ValueError("the local tier must be one of the tiers")
        self.catalog = catalog
        self.tiers = tuple(tiers)
        """Fastest first."""
        self.local = local
        """The tier every other brings a step into, and that serves it from there."""

    async def learn(self, job: str, step: int | None) -> str:
        """Ask every tier what it holds of ``job`` (only ``step``, when given). The
        newest step that only a tier the catalog does not follow holds, newer than
        every copy the catalog knows, is brought into the local tier (from its
        fastest holder that gives it); the tier it came from, or ""."""
        offers: list[tuple[Order, int, Tier]] = []
        for i, tier in enumerate(self.tiers):
            offers += [(order, i, tier) for order in await tier.holds(job, step)]
        # What the catalog knows a copy of is the restorer's choice (healthy, adopted).
        offers = [o for o in offers if not self._has_copy(job, o[0][2])]
        known = [
            s.order
            for s in self.catalog.list(job)
            if (s.local or s.in_remote) and not s.abandoned and step in (None, s.step)
        ]
        newest = max(known, default=None)
        # Newest first; for one step, the fastest tier first.
        for order, _, tier in sorted(offers, key=lambda o: (o[0], -o[1]), reverse=True):
            if newest is not None and order < newest:
                break
            try:
                await tier.bring(job, order[2], Want(None))
            except PASSED as exc:
                log.info("%s/%d: not taken from the %s tier (%s)", job, order[2], tier.name, exc)
                continue
            return tier.name
        return ""

    async def restore(
        self, job: str, step: int | None, want: Want, pick: Callable[[], Step]
    ) -> Served:
        """Serve ``pick()`` (the newest eligible step the catalog knows, or the one
        asked for: raises when there is none) from its fastest holder, choosing
        again while a choice could not be served and what is known of it changed."""
        await self.learn(job, step)
        while True:
            st = pick()
            # Held while a tier reads it: the evictor leaves it alone. (The grace
            # for files the client opens itself comes from the servicer: see served.)
            with self.catalog.in_use(st):
                served = await self.serve(st, want, explicit=step is not None)
            if served is not None:
                return served

    async def serve(self, st: Step, want: Want, explicit: bool) -> Served | None:
        """``st`` from its fastest holder; None: no tier could give it and the
        catalog's record of it changed meanwhile (choose again). ``explicit``: the
        step was asked for, so a copy that does not verify is the answer."""
        before = _record(st)
        tiers, source = self.tiers, ""
        passed: list[CkptdError] = []
        i = 0
        while i < len(tiers):
            tier = tiers[i]
            i += 1
            try:
                handed = await tier.bring(st.job, st.step, want)
            except PASSED as exc:
                passed.append(exc)
                continue
            if handed is not None or tier is self.local:
                return Served(st, handed, source or tier.name)
            # In the local tier now: served from there, its shared memory first.
            source, tiers, i = tier.name, tiers[: tiers.index(tier)], 0
        lost = [e for e in passed if isinstance(e, DataLoss)]
        if explicit and lost:
            raise lost[-1]
        if _record(st) != before:
            return None
        raise passed[-1] if passed else NotFound(f"no tier holds {st.job}/{st.step}")

    def _has_copy(self, job: str, step: int) -> bool:
        """Whether the catalog knows a copy of the step (in the local tier or the
        bucket): then the restorer's choice decides whether it counts."""
        st = self.catalog.get(job, step)
        return st is not None and (st.local or st.in_remote)


def _record(st: Step) -> tuple[asyncio.Event, bool, bool, str]:
    """What the catalog says of ``st``: its event (replaced at every transition),
    and whether a copy is local, in the bucket, or known not to verify."""
    return st.changed, st.local, st.in_remote, st.unusable
