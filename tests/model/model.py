"""What must hold: the checker's model of one node's jobs, written from the documented
rules only (docs/reliability.md "Timelines", docs/operating/retention.md), never from
the daemon's code.

The model knows what every acknowledged save held (one version number per array,
:mod:`.trees` makes the bytes), each job's timelines, the pins and milestones, and
the one retention setting a sequence runs with: the bucket keeps the newest ``keep``
steps of the job's live history and of each abandoned timeline, every milestone and
every pin (the local tier keeps no more than the bucket, so the bucket's rule is the
one that decides what must survive). From these it says which steps must still be
listed and restore bit-exact (:meth:`Model.must_keep`).

A step the rules stopped keeping once is *expendable* from then on: the daemon may
remove it at any time (even if a later save would have it kept again, it may be gone
already), and the model forgets it when the daemon no longer lists it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

Forks = tuple[tuple[int, int], ...]
"""``((timeline, first step), ...)``: where each later timeline of a job began."""


def merge(*lineages: Iterable[tuple[int, int]]) -> Forks:
    """The forks of several lineages together (one per timeline, the lowest start)."""
    out: dict[int, int] = {}
    for lineage in lineages:
        for timeline, start in lineage:
            out[timeline] = min(start, out.get(timeline, start))
    return tuple(sorted(out.items()))


class PinnedConflict(Exception):
    """The save would replace a pinned step: the daemon must refuse it (Conflict)."""


@dataclass
class Saved:
    """One acknowledged save as the model remembers it."""

    sid: int
    """Unique in the sequence; saved as the step's metadata, so a restore says which
    save's bytes it returned (the step number alone does not: timelines reuse it)."""
    job: str
    step: int
    timeline: int
    forks: Forks
    versions: tuple[int, ...]
    """One per array of the tree (trees.KEYS): what the arrays held."""
    flavor: str
    milestone: bool = False
    pinned: bool = False
    expendable: bool = False

    def label(self) -> str:
        """``job/step (save #sid, timeline t)`` for failure messages."""
        return f"{self.job}/{self.step} (save #{self.sid}, timeline {self.timeline})"


@dataclass
class JobModel:
    """The steps of one job this node may still hold, by number (one save per number:
    a save under a held number replaces it)."""

    name: str
    held: dict[int, Saved] = field(default_factory=dict)


class Model:
    """Every job of one node, and what the rules keep of each."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.jobs: dict[str, JobModel] = {}
        self._sids = itertools.count(1)
        self.archive: dict[int, Saved] = {}
        """Every save prepared, by id: a step the daemon lists after the model forgot it
        is checked against the save it claims to be."""

    def job(self, name: str) -> JobModel:
        """The job's model (created empty on first use)."""
        return self.jobs.setdefault(name, JobModel(name))

    # -- timelines ---------------------------------------------------------------------
    def lineage(self, job: str) -> Forks:
        """The forks the held steps carry (each step records the job's forks so far)."""
        return merge(*(s.forks for s in self.job(job).held.values()))

    def abandoned(self, s: Saved) -> bool:
        """A later timeline began at or below this step."""
        return any(t > s.timeline and start <= s.step for t, start in self.lineage(s.job))

    def live(self, job: str) -> list[Saved]:
        """The job's live history, oldest first."""
        held = self.job(job).held.values()
        return sorted((s for s in held if not self.abandoned(s)), key=lambda s: s.step)

    def top(self, job: str) -> Saved | None:
        """The newest step of the live history: what ``restore()`` must return."""
        live = self.live(job)
        return live[-1] if live else None

    def timeline_for(self, job: str, step: int) -> tuple[int, Forks]:
        """``(timeline, forks)`` of a new save of ``step``: a new timeline when ``step``
        is at or below the newest live step; raises :class:`PinnedConflict` when a
        pinned step holds the number."""
        held = self.job(job).held
        old = held.get(step)
        if old is not None and old.pinned:
            raise PinnedConflict(f"{old.label()} is pinned")
        forks = self.lineage(job)
        current = max([0, *(t for t, _ in forks), *(s.timeline for s in held.values())])
        top = self.top(job)
        if top is not None and step <= top.step:
            return current + 1, merge(forks, [(current + 1, step)])
        return current, forks

    # -- what happens --------------------------------------------------------------------
    def prepare(
        self, job: str, step: int, versions: tuple[int, ...], flavor: str, milestone: bool
    ) -> Saved:
        """The save the model expects if ``step`` is saved now (not yet recorded; raises
        :class:`PinnedConflict` if the daemon must refuse it)."""
        timeline, forks = self.timeline_for(job, step)
        s = Saved(next(self._sids), job, step, timeline, forks, versions, flavor, milestone)
        self.archive[s.sid] = s
        return s

    def commit(self, s: Saved) -> None:
        """An acknowledged save (or a killed trainer's that committed): it replaces
        whatever held its number."""
        self.job(s.job).held[s.step] = s

    def forget(self, job: str, step: int) -> None:
        """The daemon no longer lists an expendable step (or a save failed)."""
        self.job(job).held.pop(step, None)

    def pin(self, job: str, step: int, on: bool) -> None:
        """A pin or unpin the daemon accepted."""
        s = self.job(job).held[step]
        s.pinned = on
        if on:
            s.expendable = False  # present when pinned, so kept from now on

    def node_lost(self, survivors: set[tuple[str, int]]) -> None:
        """The root was wiped: only the steps complete in the bucket come back."""
        for job in self.jobs.values():
            for step in [n for n in job.held if (job.name, n) not in survivors]:
                del job.held[step]

    # -- what must hold ------------------------------------------------------------------
    def rule(self, job: str) -> dict[int, str]:
        """Each step the rules keep, and which rule (whether or not it is expendable)."""
        kept: dict[int, str] = {}
        for s in self.live(job)[-self.keep :]:
            kept[s.step] = "the newest steps of the live history"
        held = self.job(job).held.values()
        gone = [s for s in held if self.abandoned(s)]
        for timeline in sorted({s.timeline for s in gone}):
            group = sorted((s for s in gone if s.timeline == timeline), key=lambda s: s.step)
            for s in group[-self.keep :]:
                kept[s.step] = f"the newest steps of abandoned timeline {timeline}"
        for s in held:
            if s.milestone:
                kept[s.step] = "a milestone"
            if s.pinned:
                kept[s.step] = "pinned"
        return kept

    def must_keep(self, job: str) -> dict[int, str]:
        """The steps that must be listed and restore bit-exact now, with the rule."""
        held = self.job(job).held
        return {n: why for n, why in self.rule(job).items() if not held[n].expendable}

    def settle(self) -> None:
        """After an operation: steps no rule keeps any more become expendable."""
        for name, job in self.jobs.items():
            kept = self.rule(name)
            for s in job.held.values():
                if s.step not in kept:
                    s.expendable = True
