"""The catalog's table of steps: what it holds, the queries, the primitives every
transition uses, marks of use, and waits (:class:`~.catalog.Catalog` adds the
transitions; the two are one object, the one owner of every step's state)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from ckptd.core.errors import FailedPrecondition, InvalidArgument, NotFound
from ckptd.core.names import check_wait
from ckptd.core.timeline import Forks, merge
from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import state_name

from . import timelines
from .events import MAX_WAIT_SECONDS, EventLog
from .step import DRAINING, DURABLE, LOCAL, NEW, TRANSITIONS, IllegalTransition, Step

log = logging.getLogger("ckptd.catalog")

_Steps = list[Step]  # aliases: inside the class, ``list`` is a method
_Names = list[str]


class StepTable(EventLog):
    """The steps of every job on this node, keyed by (job, step)."""

    def __init__(
        self,
        node_id: str,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(clock, monotonic)
        self.node_id = node_id
        self._steps: dict[tuple[str, int], Step] = {}
        self._lineage: dict[str, Forks] = {}
        """Each job's forks, from the steps it has (core/timeline.py)."""
        self._replacing: dict[tuple[str, int], Step] = {}
        """Steps a save under their number is replacing, until their local copy is gone."""
        self._replaced_by: dict[tuple[str, int], int] = {}
        """Numbers a later save took, whose older save's copy this node may still have in
        the bucket: (job, step) -> the later save's timeline. Kept until the evictor
        retracted that copy or found none (:meth:`replaced_numbers`): a later save that
        leaves before its upload (superseded, evicted) retracts nothing itself."""
        self._blind: dict[str, int] = {}
        """Jobs whose saves could not read what the bucket holds of them (:meth:`blind`),
        and the timeline their first blind save began (0: none yet)."""
        self._on_disk: set[str] = set()
        """Jobs the local tier held a step of at start-up."""
        self._superseded: dict[tuple[str, int], Step] = {}
        """The newest saves superseded before their write began (no copy, so out of
        the table): what a status asks of them answers SUPERSEDED, not NotFound."""

    # -- what the bucket holds, unseen --------------------------------------------
    def blind(self, job: str) -> None:
        """The job's next save could not read this node's steps of it in the bucket
        first: unless this node's disk held the job's steps at start-up (it numbers
        from them, as every node of a multi-node job does), its timeline cannot follow
        the bucket's, so it starts one above any the bucket can hold (core/timeline.py,
        ``blind_timeline``)."""
        if job not in self._on_disk:
            self._blind.setdefault(job, 0)

    def sighted(self, job: str) -> None:
        """What the bucket holds of the job is read after all: saves number as usual."""
        self._blind.pop(job, None)

    # -- numbers a later save took ------------------------------------------------
    def replaced_numbers(self, job: str) -> dict[int, int]:
        """Step -> the timeline of the later save under that number, for this node's
        copies in the bucket that such a save replaced and that may still be there."""
        return {n: t for (j, n), t in self._replaced_by.items() if j == job}

    def retracted(self, job: str, step: int, timeline: int) -> None:
        """No copy under ``step`` older than ``timeline`` is in the bucket any more."""
        if self._replaced_by.get((job, step)) == timeline:
            del self._replaced_by[(job, step)]

    def _taken(self, job: str, step: int, timeline: int) -> None:
        """A save of ``timeline`` took ``step``'s number: older copies are replaced."""
        key = (job, step)
        self._replaced_by[key] = max(timeline, self._replaced_by.get(key, timeline))

    # -- queries -----------------------------------------------------------------
    def get(self, job: str, step: int) -> Step | None:
        """The step, or None."""
        return self._steps.get((job, step))

    def require(self, job: str, step: int) -> Step:
        """The step, or NotFound."""
        st = self._steps.get((job, step))
        if st is None:
            raise NotFound(
                f"no save of step {step} for job {job!r} on this node; `ckptd ls {job}` lists them"
            )
        return st

    def steps(self) -> _Steps:
        """Every step (a copy of the list: safe to transition while iterating)."""
        return list(self._steps.values())

    def list(self, job: str = "") -> _Steps:
        """Steps of one job (or all), newest save first within each job: the live
        history by step, then the abandoned steps (core/timeline.py)."""
        rows = [s for s in self._steps.values() if not job or s.job == job]
        rows.sort(key=lambda s: s.order, reverse=True)
        rows.sort(key=lambda s: s.job)  # stable: newest first within each job
        return rows

    def jobs(self) -> _Names:
        """Every job with a step here, sorted."""
        return sorted({s.job for s in self._steps.values()})

    def lineage(self, job: str) -> Forks:
        """The job's forks: ``(timeline, first step)`` of each timeline after the first."""
        return self._lineage.get(job, ())

    def live(self, job: str) -> _Steps:
        """The job's steps that are not abandoned (its live history), newest first."""
        return [s for s in self.list(job) if not s.abandoned]

    def references(self, st: Step) -> frozenset[int]:
        """The steps here whose files ``st``'s references read: each holder under its
        number, unless the step under that number now is another timeline's (a save
        replaced it: the holder's copy is held, local/held.py)."""
        out = set()
        for n, timeline in st.reads().items():
            other = self._steps.get((st.job, n))
            if other is None or other.timeline == timeline:
                out.add(n)
        return frozenset(out)

    def read_copies(self, job: str) -> set[tuple[int, int]]:
        """``(step, timeline)`` of every holder the steps of ``job`` on the disk (or in use)
        read: the copies that must stay, in every tier holding those steps."""
        return {
            (n, timeline)
            for s in self._steps.values()
            if s.job == job and (s.local or s.busy)
            for n, timeline in s.reads().items()
        }

    def local_timeline(self, job: str, step: int) -> int | None:
        """The timeline of the local copy of ``job``'s step ``step``; None if none."""
        st = self._steps.get((job, step))
        return st.manifest.timeline if st and st.local and st.manifest else None

    def held_reads(self, st: Step) -> set[tuple[int, int]]:
        """``(step, timeline)`` of each holder ``st`` reads that is not the step under its
        number here (replaced by a later timeline's save, or gone from the catalog):
        a held copy, if anything (local/held.py, remote/held.py)."""
        return {
            (n, timeline)
            for n, timeline in st.reads().items()
            if (other := self._steps.get((st.job, n))) is None or other.timeline != timeline
        }

    def count(self, state: int) -> int:
        """Steps in ``state``."""
        return sum(1 for s in self._steps.values() if s.state == state)

    def _move(self, st: Step, to: int, **values: Any) -> None:
        if to not in TRANSITIONS[st.state]:
            raise IllegalTransition(
                f"{st.job}/{st.step}: {state_name(st.state)} -> {state_name(to)} is not a "
                "transition ckptd makes"
            )
        st._set(state=to, **values)

    def _add(self, st: Step) -> Step:
        self._steps[st.key] = st
        self._relineage(st.job, st)
        return st

    def _forget_superseded(self, st: Step) -> None:
        """``st`` (SUPERSEDED, no copy anywhere) leaves the table; the newest 256 such
        are remembered for :meth:`wait`."""
        if self._steps.get(st.key) is st:
            del self._steps[st.key]
        self._superseded.pop(st.key, None)
        self._superseded[st.key] = st
        while len(self._superseded) > 256:
            del self._superseded[next(iter(self._superseded))]

    def _drop(self, st: Step) -> None:
        self._move(st, NEW)
        if self._steps.get(st.key) is st:
            del self._steps[st.key]
            self._relineage(st.job, st)

    def _relineage(self, job: str, changed: Step) -> None:
        """Keep the job's forks and each step's abandoned flag current after ``changed``
        came, went or failed (catalog/timelines.py): a scan of the job only when the
        forks may have changed, which only a fork does."""
        forks = self.lineage(job)
        if changed.in_lineage and merge(forks, changed.forks) == forks:
            steps: list[Step] = [changed] if self._steps.get(changed.key) is changed else []
        elif not changed.forks:
            return  # it carried no fork: the lineage is what it was
        else:
            steps = [s for s in self._steps.values() if s.job == job]
            forks = timelines.lineage(steps)
            if forks:
                self._lineage[job] = forks
            else:
                self._lineage.pop(job, None)
        for s, gone in timelines.flips(steps, forks):
            s._set(abandoned=gone)
            if not gone:
                log.info("%s/%d is live again: the timeline that left it failed", job, s.step)

    # -- pins and use ------------------------------------------------------------
    def check_pinnable(self, st: Step) -> None:
        """Raise unless the step has a complete copy that a pin could keep: a save still
        in progress is FailedPrecondition (pin it once it is LOCAL); a step with no copy
        left (retention removed it, or its save failed) is NotFound, as if unknown."""
        if st.local or st.in_remote:
            return
        if st.state == pb.SAVE_STATE_STAGING:
            raise FailedPrecondition(
                f"step {st.step} of job {st.job!r} has no complete copy to pin "
                f"({state_name(st.state)}); pin it once it is LOCAL"
            )
        raise NotFound(
            f"step {st.step} of job {st.job!r} has no copy left to pin "
            f"({state_name(st.state)}): retention removed it, or its save failed; "
            "pin a step `ckptd ls` lists"
        )

    def set_pinned(self, st: Step, pinned: bool) -> None:
        """Pin (no tier evicts it) or unpin a step that has a complete copy."""
        self.check_pinnable(st)
        st._set(pinned=pinned)
        self._emit(st, pb.STEP_EVENT_PINNED if pinned else pb.STEP_EVENT_UNPINNED)

    @contextlib.contextmanager
    def in_use(self, st: Step, evicting: bool = False) -> Iterator[Step]:
        """Mark a copy as being read (a fetch, a put-back): the evictor leaves it alone.
        ``evicting``: the evictor itself holds it while it removes the local copy."""
        st._set(busy=st.busy + 1, evicting=st.evicting or evicting)
        try:
            yield st
        finally:
            st._set(busy=st.busy - 1, evicting=st.evicting and not evicting)
            if not st.busy:  # wake :meth:`quiet` (and any waiter: they look again)
                st.changed.set()
                st._set(changed=asyncio.Event())
                self._freed(st)

    def served(self, st: Step) -> None:
        """A Restore (or put-back) is reading it now: no eviction for a grace period."""
        st._set(read_at=self._monotonic())

    def read_recently(self, st: Step, grace_seconds: float) -> bool:
        """Whether a Restore read it less than ``grace_seconds`` ago."""
        return self._monotonic() - st.read_at < grace_seconds

    # -- waiting -----------------------------------------------------------------
    def replacing(self, st: Step) -> Step | None:
        """The step ``st``'s save replaces whose local copy is still on disk, if any."""
        return self._replacing.get(st.key)

    async def quiet(self, st: Step) -> None:
        """Wait until nothing reads ``st``'s copies (no restore, eviction or upload in
        flight): then its files can go."""
        while True:
            changed = st.changed
            if not st.busy and st.state != DRAINING:
                return
            await changed.wait()

    async def wait(self, job: str, step: int, target: int, timeout: float) -> Step:
        """Wait until a step reaches ``target`` (LOCAL or DURABLE), fails for good,
        or ``timeout`` passes; a stopping daemon answers at once."""
        gone = None if (job, step) in self._steps else self._superseded.get((job, step))
        if target not in (LOCAL, DURABLE):
            if target == NEW:
                return gone or self.require(job, step)
            raise InvalidArgument(
                f"cannot wait for state {state_name(target)}; wait for LOCAL or DURABLE "
                "(or leave wait_for unset to ask without waiting)"
            )
        deadline = self._monotonic() + check_wait("timeout_seconds", timeout, MAX_WAIT_SECONDS)
        st = gone or self.require(job, step)
        while True:
            if st.reached(target) or st.final(target):
                return st
            left = deadline - self._monotonic()
            if left <= 0 or self.stopping.is_set():
                return st
            await self._either(st.changed, left)
            # A save superseded meanwhile has left the table: its last state answers.
            st = self._steps.get((job, step), st)
