"""The drain's order with references: a step goes up only after its holders.

An incremental step's rank files hold only what changed; the rest is read from
older steps' rank files, its holders (core/increments.py), which may have holders
of their own. The bucket must be able to restore every step it holds, so a step
is published only once every one of its holders, transitively, is complete in
the bucket: the drain uploads missing holders first, oldest first, whatever its
pace or the remote policy would have said (retention keeps them wanted:
retention/references.py). The check is made again right before the step's
marker (publish.py), since the evictor may have taken a holder out of the bucket
meanwhile. A holder with no copy in the bucket nor on the local disk cannot
happen while the local tier keeps what its steps reference; if it does, the
step's upload fails with the reason rather than publish a step the bucket could
not restore.
"""

from __future__ import annotations

from collections.abc import Callable, Set

from ckptd.proto import ckptd_pb2 as pb

from ..catalog import Step
from ..catalog.roles import Steps
from ..retention.references import referenced

PENDING = (pb.SAVE_STATE_LOCAL, pb.SAVE_STATE_DRAINING)


class Holders:
    """What a step to upload needs in the bucket first."""

    def __init__(
        self,
        catalog: Steps,
        retracting: Set[tuple[str, int]],
        held_in_bucket: Callable[[str], Set[tuple[int, int]]] = lambda job: frozenset(),
    ) -> None:
        self.catalog = catalog
        self.retracting = retracting
        """Steps the evictor is taking out of the bucket right now (retention/planner.py)."""
        self.held_in_bucket = held_in_bucket
        """``(step, timeline)`` of a job's held copies in the bucket (remote/held.py)."""

    def _holders_of(self, job: str) -> dict[int, frozenset[int]]:
        return {s.step: self.catalog.references(s) for s in self.catalog.list(job)}

    def needed(self, st: Step) -> list[int]:
        """Every step ``st`` references, transitively, oldest first."""
        known = self._holders_of(st.job)
        return sorted(referenced([st.step], lambda s: known.get(s, frozenset())))

    def in_bucket(self, job: str, step: int) -> bool:
        """This node's copy of the step is complete in the bucket and staying there."""
        h = self.catalog.get(job, step)
        return (
            h is not None
            and self.catalog.node_id in h.remote_nodes
            and (job, step) not in self.retracting
        )

    def first_missing(self, st: Step) -> Step | str | None:
        """The oldest holder of ``st`` not in the bucket (to upload first), None if they
        all are, or why ``st`` can never be uploaded (a holder with no copy left)."""
        for step in self.needed(st):
            if self.in_bucket(st.job, step):
                continue
            h = self.catalog.get(st.job, step)
            if h is None or not h.local:
                return (
                    f"step {step}, whose rank files step {st.step} references, is neither in "
                    "the bucket nor on the local disk: the bucket could not restore step "
                    f"{st.step}, so it is not uploaded (its local copy stays restorable)"
                )
            return h
        return None

    def missing_reason(self, st: Step) -> str:
        """Why ``st`` may not be committed in the bucket now ("" if it may): a holder is
        not complete there (publish.py asks right before the marker)."""
        missing = [s for s in self.needed(st) if not self.in_bucket(st.job, s)]
        if missing:
            return (
                f"step {missing[0]}, whose rank files step {st.step} references, is not "
                "complete in the bucket: it goes up first"
            )
        held = self.held_in_bucket(st.job)
        gone = sorted(k for k in self.catalog.held_reads(st) if k not in held)
        if gone:
            step, timeline = gone[0]
            return (
                f"step {step} of timeline {timeline}, whose rank files step {st.step} "
                "references (a later save replaced it), has no copy in the bucket"
            )
        return ""

    def pace_keeps(self, st: Step) -> set[int]:
        """Steps the pace must not supersede when ``st`` goes up: the holders of ``st``
        and of the milestones still waiting (they go up whatever the pace)."""
        steps = self.catalog.list(st.job)
        known = {s.step: self.catalog.references(s) for s in steps}
        seeds = [st.step, *(s.step for s in steps if s.state in PENDING and s.milestone)]
        return set(referenced(seeds, lambda s: known.get(s, frozenset())))
