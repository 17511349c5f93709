"""The step catalog: the one owner of every step's state on this node.

Every service (the saver, the drain, the evictor, restore, adoption, pins) asks
the catalog for a transition; none assigns a step's fields. Each transition is
checked against :data:`TRANSITIONS`, wakes the step's waiters and emits one
:class:`Event`, which ``ckptd events``, the status, the metrics and the tests
read. Runs on the event loop: no locks, no I/O.

A step's ``state`` is its lifecycle (``SaveState`` in the proto); which tiers
hold a copy is separate (``manifest`` for the local copy, ``remote_nodes`` for
the bucket's markers), because copies come and go under any state: a DURABLE
step is evicted locally and fetched back, a LOCAL step has another node's marker.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ckptd.core.errors import Conflict
from ckptd.core.manifest import Manifest
from ckptd.core.timeline import Forks, merge, replaced
from ckptd.proto import ckptd_pb2 as pb

from . import timelines
from .step import (
    DRAINING,
    DURABLE,
    FAILED,
    LOCAL,
    NEW,
    STAGING,
    SUPERSEDED,
    IllegalTransition,
    Step,
)
from .table import StepTable

log = logging.getLogger("ckptd.catalog")


class Catalog(StepTable):
    """Every step of every job on this node, and the one place their state changes:
    the transitions (the table, the queries and the waits are :class:`StepTable`'s)."""

    # -- the local tier --------------------------------------------------------------
    def recovered(self, manifest: Manifest, pinned: bool) -> Step:
        """A committed step found in the local tier at start-up: LOCAL."""
        st = self._committed_here(manifest, pinned)
        self._on_disk.add(st.job)
        self._emit(st, pb.STEP_EVENT_RECOVERED)
        return st

    def _committed_here(self, manifest: Manifest, pinned: bool) -> Step:
        """A new step whose copy is committed in the local tier: LOCAL."""
        st = Step(
            manifest.job,
            manifest.step,
            milestone=manifest.milestone,
            node_ranks=tuple(r.rank for r in manifest.ranks),
            world_size=manifest.world_size,
            handoff_at=manifest.created_unix,
            local_at=manifest.created_unix,
            created_unix=manifest.created_unix,
            metrics=dict(manifest.metrics),
            adopted=manifest.adopted,
            pinned=pinned,
            timeline=manifest.timeline,
            forks=manifest.forks,
        )
        self._move(st, LOCAL, manifest=manifest)
        return self._add(st)

    def begin(
        self,
        job: str,
        step: int,
        *,
        node_ranks: tuple[int, ...] = (),
        world_size: int = 1,
        adopted: bool = False,
        milestone: bool = False,
        metrics: Mapping[str, float] | None = None,
        timeline: tuple[int, Forks] | None = None,
    ) -> Step:
        """The first handoff of a save (or an adoption) of a step: STAGING.

        A save at or below the newest step of the job's live history starts a new
        timeline (:meth:`next_timeline`; core/timeline.py). A step already under this
        number (one the new timeline abandons, an abandoned one, a save that failed)
        is replaced: it leaves the catalog now, and the caller removes its local copy
        (:meth:`replacing`) before it commits; a pinned one refuses the save.
        ``timeline``: ``(timeline, forks)`` decided when the save was acknowledged (a
        journal replay); decided here when None.
        """
        old = self._steps.get((job, step))
        if old is not None and old.state == STAGING:
            raise Conflict(
                f"step {step} of job {job!r} is being saved here already "
                f"({'an adoption' if old.adopted else 'a save'} in progress); save under a "
                "new step number"
            )
        if old is not None and old.pinned:
            raise Conflict(
                f"step {step} of job {job!r} is pinned, and a save under its number would "
                f"replace it; unpin it (`ckptd unpin {job} {step}`) or save under another "
                "step number"
            )
        before = self.lineage(job)
        number, forks = timeline or self.next_timeline(job, step)
        if timeline is None and job in self._blind:  # numbered on from here while it lasts
            self._blind[job] = max(number, self._blind[job])
        if old is not None:
            self._replace(old, number)
        st = Step(
            job,
            step,
            node_ranks=node_ranks,
            world_size=world_size,
            adopted=adopted,
            milestone=milestone,
            metrics=dict(metrics or {}),
            handoff_at=self._clock(),
            timeline=number,
            forks=forks,
        )
        self._move(st, STAGING)
        self._emit(self._add(st), pb.STEP_EVENT_STAGED, "adopted" if adopted else "")
        if dict(forks).get(number) == step and (number, step) not in before:
            self._forked(st)
        return st

    def next_timeline(self, job: str, step: int) -> tuple[int, Forks]:
        """``(timeline, forks)`` for a new save of ``step``: the job's current timeline,
        or a new one when ``step`` is at or below the newest step of its live history
        (or when the job is :meth:`blind`: a new one from the clock)."""
        steps = [s for s in self._steps.values() if s.job == job]
        blind = self._blind.get(job)
        now = self._clock() if blind is not None else 0.0
        return timelines.next_timeline(steps, self.lineage(job), step, now, blind)

    def _forked(self, st: Step) -> None:
        """Tell once (a log line and a TIMELINE event) that a save began a new timeline."""
        job_steps = (s for s in self._steps.values() if s.job == st.job)
        newer, span = timelines.left_behind(job_steps, st.step)
        log.warning(
            "job %s: step %d begins timeline %d (a rollback or a rerun under a reused job "
            "name, at or below the newest step; or a save this node made before it could "
            "read the bucket's record of the job). Steps %s are abandoned: restore() and "
            "retention follow the new timeline, `ckptd ls` lists them as abandoned "
            "(docs/reliability.md, Timelines)",
            st.job,
            st.step,
            st.timeline,
            span or "(none left here)",
        )
        self._emit(
            st,
            pb.STEP_EVENT_TIMELINE,
            f"timeline {st.timeline} begins at step {st.step}; abandoned: {span or 'none here'}",
            timeline=str(st.timeline),
            abandoned=",".join(map(str, newer)),
        )

    def _replace(self, old: Step, timeline: int) -> None:
        """A new save takes ``old``'s number: ``old`` leaves the catalog (a save that
        failed with nothing kept just goes); its local copy, if any, stays until the
        saver removes it (:meth:`replacing`, :meth:`quiet`, :meth:`replaced`)."""
        self._taken(old.job, old.step, timeline)
        if not old.in_lineage:
            self._drop(old)
            return
        del self._steps[old.key]
        if old.local:
            self._replacing[old.key] = old
        log.warning(
            "%s/%d (timeline %d) is replaced by a new save under its number (timeline %d)",
            old.job,
            old.step,
            old.timeline,
            timeline,
        )
        self._emit(old, pb.STEP_EVENT_REPLACED, f"replaced by a save of timeline {timeline}")

    def replaced(self, old: Step) -> None:
        """The local copy of a replaced step is gone (moved out of view)."""
        if self._replacing.get(old.key) is old:
            del self._replacing[old.key]
        old._set(manifest=None, peers=frozenset())

    def joined(self, st: Step, milestone: bool, metrics: Mapping[str, float]) -> None:
        """Another rank of a STAGING save handed off (its flags and metrics count too)."""
        if st.state != STAGING:
            raise IllegalTransition(f"{st!r} is not STAGING: no rank can join it")
        st._set(milestone=st.milestone or milestone, metrics={**st.metrics, **metrics})

    def committed(self, st: Step, manifest: Manifest) -> None:
        """Every rank is written and the step renamed into place: LOCAL."""
        now = self._clock()
        self._move(
            st,
            LOCAL,
            manifest=manifest,
            local_at=now,
            created_unix=manifest.created_unix,
            metrics=dict(manifest.metrics),  # with the daemon's own (ckptd.nonfinite)
        )
        self._emit(st, pb.STEP_EVENT_LOCAL, f"{manifest.size_bytes} bytes")

    def failed(self, st: Step, reason: str, stage: str, newer: bool = False) -> None:
        """The save (``stage`` = "local") or its upload ("remote") failed for good;
        ``newer``: a save the job's newer save took the place of before its write
        began (SUPERSEDED, then forgotten: local/order.py). A step that already
        failed, or left the catalog meanwhile, stays as it is."""
        if st.state in (FAILED, SUPERSEDED, NEW):
            return
        self._move(st, SUPERSEDED if newer else FAILED, error=reason)
        if stage == "local":  # the number is the older save's again, in the bucket too
            self.retracted(st.job, st.step, st.timeline)
        if self._steps.get(st.key) is st:
            self._relineage(st.job, st)  # a fork whose only save failed is forgotten
        kind = pb.STEP_EVENT_SUPERSEDED if newer else pb.STEP_EVENT_FAILED
        self._emit(st, kind, reason, stage=stage)
        if newer:  # no copy anywhere: out of the table
            self._forget_superseded(st)

    def abandoned(self, st: Step, reason: str) -> None:
        """An adoption that never committed: the step is forgotten."""
        self._drop(st)
        self._emit(st, pb.STEP_EVENT_ABANDONED, reason)

    def fetched(self, st: Step, manifest: Manifest, **attributes: str) -> None:
        """A copy from the bucket was verified and committed locally."""
        if st.local:
            raise IllegalTransition(f"{st!r} already has a local copy")
        st._set(
            manifest=manifest,
            read_at=self._monotonic(),  # fetched to be read: the evictor leaves it alone
            local_at=self._clock(),
            milestone=st.milestone or manifest.milestone,
            created_unix=manifest.created_unix,
            metrics=dict(manifest.metrics),
            timeline=manifest.timeline,
            forks=merge(st.forks, manifest.forks),
        )
        self._relineage(st.job, st)
        self._emit(st, pb.STEP_EVENT_FETCHED, **attributes)

    def in_memory(self, st: Step, ranks: frozenset[int]) -> None:
        """The memory tier keeps ``ranks``' files of ``st`` (local/memory.py): listed as
        a tier of the step; not a transition, so no event."""
        if self.get(st.job, st.step) is st:
            st._set(memory_ranks=ranks)

    def replicating(self, st: Step, nodes: frozenset[str]) -> None:
        """A replica of ``st`` goes to peer daemons ``nodes``, which drop the job's
        older replicas once they take it: those stop claiming ``nodes`` before it is
        sent, so an answer lost with the peer leaves no claim on a removed replica
        (listing less than a peer holds is safe: a restore asks the peer itself)."""
        for other in self.list(st.job):
            if other is not st and other.replica_nodes & nodes:
                other._set(replica_nodes=other.replica_nodes - nodes)

    def replicated(self, st: Step, nodes: frozenset[str]) -> None:
        """This node's part of ``st`` is a complete replica on peer daemons ``nodes``
        (older steps lost those nodes: :meth:`replicating`)."""
        self.replicating(st, nodes)
        st._set(replica_nodes=st.replica_nodes | nodes)
        self._emit(st, pb.STEP_EVENT_REPLICATED, nodes=",".join(sorted(nodes)))

    def peer_fetched(self, manifest: Manifest, node: str) -> Step:
        """A peer's replica of this node's part was verified and committed locally (a
        node that lost its disk): the step is LOCAL again (attributes: ``node``, the
        peer, and ``via`` "peer"). A replica of a later save than the one known under
        its number (the bucket's copy of an older timeline's, which a save the bucket
        never got replaced) replaces it: the drain retracts that copy before it
        uploads this one (lifecycle/replaced.py)."""
        st = self._steps.get((manifest.job, manifest.step))
        if st is not None and st.timeline < manifest.timeline and not st.local:
            self._replace(st, manifest.timeline)  # the bucket's copy is an older save's
            st = None
        if st is not None:
            if st.timeline != manifest.timeline:  # the caller refuses an older save's
                raise IllegalTransition(f"{st!r}: a replica of timeline {manifest.timeline}")
            self.fetched(st, manifest, node=node, via="peer")
            return st
        st = self._committed_here(manifest, pinned=False)
        st._set(read_at=self._monotonic())  # fetched to be read, as from the bucket
        self._emit(st, pb.STEP_EVENT_FETCHED, node=node, via="peer")
        return st

    def peers_fetched(self, st: Step, node: str) -> None:
        """Another node's part of the step is verified in ``<root>/.peers``."""
        st._set(peers=st.peers | {node})
        self._emit(st, pb.STEP_EVENT_PEERS_FETCHED, node=node)

    def local_removed(self, st: Step, why: int, detail: str) -> None:
        """The local copy is gone (``why``: STEP_EVENT_EVICTED_LOCAL or _SET_ASIDE).
        A step with no copy left in any tier leaves the catalog, unless the drain is
        uploading it right now (a copy set aside as corrupt): the drain ends it."""
        if not st.local:
            raise IllegalTransition(f"{st!r} has no local copy to remove")
        # What its references read stays known: the bucket's copy needs those too.
        st._set(manifest=None, peers=frozenset(), holders=st.references())
        if not st.in_remote and st.state != DRAINING:
            self._drop(st)
        self._emit(st, why, detail)

    # -- the remote tier -------------------------------------------------------------
    def draining(self, st: Step) -> None:
        """The drain starts uploading it."""
        self._move(st, DRAINING, error="")
        self._emit(st, pb.STEP_EVENT_DRAINING)

    def retrying(self, st: Step, reason: str) -> None:
        """A transient upload error; the drain tries again after a pause."""
        if st.state != DRAINING:
            raise IllegalTransition(f"{st!r} is not DRAINING")
        st._set(error=reason)
        self._emit(st, pb.STEP_EVENT_RETRYING, reason)

    def requeued(self, st: Step, reason: str) -> None:
        """Back in the queue: a newer step goes first, the daemon stops, a failed
        upload (its local copy intact) is tried again, or a newer step to upload
        references it."""
        if st.state in (FAILED, SUPERSEDED) and not st.local:
            raise IllegalTransition(f"{st!r} has no local copy to upload")
        self._move(st, LOCAL)
        self._emit(st, pb.STEP_EVENT_REQUEUED, reason)

    def durable(self, st: Step, **attributes: str) -> None:
        """This node's part is complete in the bucket (its marker is written)."""
        self._move(
            st,
            DURABLE,
            error="",
            durable_at=self._clock(),
            remote_nodes=st.remote_nodes | {self.node_id},
        )
        self._emit(st, pb.STEP_EVENT_DURABLE, **attributes)

    def superseded(self, st: Step, reason: str) -> None:
        """The bucket will not hold this step (a newer one went up, or retention removed it)."""
        self._move(st, SUPERSEDED, error=reason)
        self._emit(st, pb.STEP_EVENT_SUPERSEDED, reason)

    def discovered(
        self,
        job: str,
        step: int,
        nodes: frozenset[str] | set[str],
        adopted: bool,
        *,
        pinned: bool = False,
        created_unix: float = 0.0,
        milestone: bool = False,
        metrics: Mapping[str, float] | None = None,
        timeline: int | None = 0,
        forks: Forks = (),
        holders: frozenset[int] | None = None,
    ) -> Step | None:
        """Complete copies of ``step`` found in the bucket (markers of ``nodes``).

        A step not known here enters as DURABLE (remote only; ``created_unix``,
        ``milestone``, ``metrics``, ``timeline`` and ``forks`` come from its marker or
        the node's index, for retention and timelines); a LOCAL step whose marker
        from this node is there is DURABLE too. Copies of another timeline than the
        step known here under that number are other saves: ignored (None; an older
        one is recorded as replaced, :meth:`replaced_numbers`), unless this node's is
        of a later save (``timelines.outdated``): the step is then the bucket's. So is
        a replaced save's copy (a later timeline began with a save under its number,
        or one was seen here) when no step is known under it: the replacing save may
        have left before its upload retracted it (the drain does: lifecycle/replaced.py).
        ``timeline=None``: not known (a marker listed, not read): the known step's.
        """
        st = self._steps.get((job, step))
        if st is not None and timelines.outdated(st, self.node_id in nodes, timeline):
            self._replace(st, timeline or 0)  # its local copy leaves view before a fetch
            st = None
        later = self._replaced_by.get((job, step), -1)
        if (
            st is None
            and timeline is not None
            and (replaced(timeline, step, self.lineage(job)) or later > timeline)
        ):
            log.info("%s/%d: the bucket's copy of nodes %s is of timeline %d, which a later "
                     "save under this number replaced: not a step (the drain retracts it)",
                     job, step, ",".join(sorted(nodes)), timeline)  # fmt: skip
            return None
        if st is not None and timeline is not None and timeline != st.timeline:
            if timeline < st.timeline:  # replaced by it: out once no upload of it will be
                self._taken(job, step, st.timeline)
            log.info("%s/%d: the bucket's copy of nodes %s is of timeline %d, this step of "
                     "%d: not a copy of it", job, step, ",".join(sorted(nodes)), timeline,
                     st.timeline)  # fmt: skip
            return None
        if st is None:
            st = Step(
                job,
                step,
                created_unix=created_unix,
                milestone=milestone,
                metrics=dict(metrics or {}),
                timeline=timeline or 0,
                forks=forks,
            )
            self._move(st, DURABLE)
            before = self.lineage(job)
            self._add(st)
            if self.lineage(job) != before:
                self._forget_replaced(job)
        new_nodes = frozenset(nodes) - st.remote_nodes
        new_pin = pinned and not st.pinned
        st._set(
            remote_nodes=st.remote_nodes | frozenset(nodes),
            adopted=st.adopted or adopted,
            pinned=st.pinned or pinned,
            holders=st.holders if holders is None else holders,
        )
        if st.state == LOCAL and self.node_id in st.remote_nodes:
            self._move(st, DURABLE)
        if new_nodes or new_pin:
            self._emit(st, pb.STEP_EVENT_DISCOVERED, nodes=",".join(sorted(new_nodes)))
        return st

    def _forget_replaced(self, job: str) -> None:
        """Bucket copies taken in before a step carrying a later fork was (a node's
        index is read oldest step first) that the lineage now says were replaced: not
        steps (:meth:`discovered`); the drain retracts them (lifecycle/replaced.py)."""
        forks = self.lineage(job)
        for s in [s for s in self._steps.values() if s.job == job]:
            if not s.local and not s.pinned and replaced(s.timeline, s.step, forks):
                log.info("%s/%d (timeline %d) is a replaced save's copy: not a step",
                         job, s.step, s.timeline)  # fmt: skip
                self._drop(s)

    def unusable(self, st: Step, reason: str) -> None:
        """No copy of the step verifies in any tier (the local one set aside, the
        bucket's corrupt): restore serves an older step; ``ls`` shows why."""
        st._set(unusable=reason)
        self._emit(st, pb.STEP_EVENT_SET_ASIDE, reason, tier="remote")

    def remote_removed(self, st: Step, detail: str) -> None:
        """Retention deleted this node's copy from the bucket (its marker first)."""
        st._set(remote_nodes=st.remote_nodes - {self.node_id})
        if not st.local and not st.remote_nodes:
            self._drop(st)
        elif st.local and st.state == DURABLE:
            self._move(st, SUPERSEDED, error=detail)
        self._emit(st, pb.STEP_EVENT_EVICTED_REMOTE, detail)
