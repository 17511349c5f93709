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

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ckptd.core.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound
from ckptd.core.manifest import Manifest
from ckptd.core.names import check_wait
from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import state_name

from .events import MAX_WAIT_SECONDS, EventLog
from .step import (
    DRAINING,
    DURABLE,
    FAILED,
    LOCAL,
    NEW,
    STAGING,
    SUPERSEDED,
    TRANSITIONS,
    Event,
    IllegalTransition,
    Step,
)

log = logging.getLogger("ckptd.catalog")

_Steps = list[Step]  # aliases: inside Catalog, ``list`` is a method
_Names = list[str]
_Events = list[Event]


class Catalog(EventLog):
    """Every step of every job on this node, and the one place their state changes."""

    def __init__(
        self,
        node_id: str,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(clock, monotonic)
        self.node_id = node_id
        self._steps: dict[tuple[str, int], Step] = {}

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
        """Steps of one job (or all), newest first within each job."""
        rows = [s for s in self._steps.values() if not job or s.job == job]
        return sorted(rows, key=lambda s: (s.job, -s.step))

    def jobs(self) -> _Names:
        """Every job with a step here, sorted."""
        return sorted({s.job for s in self._steps.values()})

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
        return st

    def _drop(self, st: Step) -> None:
        self._move(st, NEW)
        if self._steps.get(st.key) is st:
            del self._steps[st.key]

    # -- the local tier --------------------------------------------------------------
    def recovered(self, manifest: Manifest, pinned: bool) -> Step:
        """A committed step found in the local tier at start-up: LOCAL."""
        st = self._committed_here(manifest, pinned)
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
    ) -> Step:
        """The first handoff of a save (or an adoption) of a new step: STAGING.

        A step that FAILED may be saved again under its number: it starts over.
        """
        old = self._steps.get((job, step))
        if old is not None and old.state != FAILED:
            raise Conflict(
                f"step {step} of job {job!r} already exists here ({state_name(old.state)}); "
                "save under a new step number"
            )
        if old is not None:
            self._drop(old)
        st = Step(
            job,
            step,
            node_ranks=node_ranks,
            world_size=world_size,
            adopted=adopted,
            milestone=milestone,
            metrics=dict(metrics or {}),
            handoff_at=self._clock(),
        )
        self._move(st, STAGING)
        self._emit(self._add(st), pb.STEP_EVENT_STAGED, "adopted" if adopted else "")
        return st

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

    def failed(self, st: Step, reason: str, stage: str) -> None:
        """The save (``stage`` = "local") or its upload ("remote") failed for good.
        A step that already failed, or left the catalog meanwhile, stays as it is."""
        if st.state in (FAILED, NEW):
            return
        self._move(st, FAILED, error=reason)
        self._emit(st, pb.STEP_EVENT_FAILED, reason, stage=stage)

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
        )
        self._emit(st, pb.STEP_EVENT_FETCHED, **attributes)

    def replicated(self, st: Step, nodes: frozenset[str]) -> None:
        """This node's part of ``st`` is a complete replica on peer daemons ``nodes``;
        they drop their older replica of the job, so older steps lose those nodes."""
        for other in self.list(st.job):
            if other is not st and other.replica_nodes & nodes:
                other._set(replica_nodes=other.replica_nodes - nodes)
        st._set(replica_nodes=st.replica_nodes | nodes)
        self._emit(st, pb.STEP_EVENT_REPLICATED, nodes=",".join(sorted(nodes)))

    def peer_fetched(self, manifest: Manifest, node: str) -> Step:
        """A peer's replica of this node's part was verified and committed locally (a
        node that lost its disk): the step is LOCAL again (attributes: ``node``, the
        peer, and ``via`` "peer")."""
        st = self._steps.get((manifest.job, manifest.step))
        if st is not None:
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
        st._set(manifest=None, peers=frozenset())
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
        """Back in the queue: a newer step goes first, the daemon stops, or a failed
        upload (its local copy intact) is tried again."""
        if st.state == FAILED and not st.local:
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
    ) -> Step:
        """Complete copies of ``step`` found in the bucket (markers of ``nodes``).

        A step not known here enters as DURABLE (remote only; ``created_unix``,
        ``milestone`` and ``metrics`` come from its marker, for retention); a LOCAL
        step whose marker from this node is there is DURABLE too.
        """
        st = self._steps.get((job, step))
        if st is None:
            st = Step(
                job,
                step,
                created_unix=created_unix,
                milestone=milestone,
                metrics=dict(metrics or {}),
            )
            self._move(st, DURABLE)
            self._add(st)
        new_nodes = frozenset(nodes) - st.remote_nodes
        new_pin = pinned and not st.pinned
        st._set(
            remote_nodes=st.remote_nodes | frozenset(nodes),
            adopted=st.adopted or adopted,
            pinned=st.pinned or pinned,
        )
        if st.state == LOCAL and self.node_id in st.remote_nodes:
            self._move(st, DURABLE)
        if new_nodes or new_pin:
            self._emit(st, pb.STEP_EVENT_DISCOVERED, nodes=",".join(sorted(new_nodes)))
        return st

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

    # -- pins and use ------------------------------------------------------------
    def check_pinnable(self, st: Step) -> None:
        """Raise unless the step has a complete copy that a pin could keep."""
        if not st.local and not st.in_remote:
            raise FailedPrecondition(
                f"step {st.step} of job {st.job!r} has no complete copy to pin "
                f"({state_name(st.state)})"
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

    def served(self, st: Step) -> None:
        """A Restore (or put-back) is reading it now: no eviction for a grace period."""
        st._set(read_at=self._monotonic())

    def read_recently(self, st: Step, grace_seconds: float) -> bool:
        """Whether a Restore read it less than ``grace_seconds`` ago."""
        return self._monotonic() - st.read_at < grace_seconds

    # -- waiting -----------------------------------------------------------------
    async def wait(self, job: str, step: int, target: int, timeout: float) -> Step:
        """Wait until a step reaches ``target`` (LOCAL or DURABLE), fails for good,
        or ``timeout`` passes; a stopping daemon answers at once."""
        if target not in (LOCAL, DURABLE):
            if target == NEW:
                return self.require(job, step)
            raise InvalidArgument(
                f"cannot wait for state {state_name(target)}; wait for LOCAL or DURABLE "
                "(or leave wait_for unset to ask without waiting)"
            )
        deadline = self._monotonic() + check_wait("timeout_seconds", timeout, MAX_WAIT_SECONDS)
        while True:
            st = self.require(job, step)
            if st.reached(target) or st.final(target):
                return st
            left = deadline - self._monotonic()
            if left <= 0 or self.stopping.is_set():
                return st
            await self._either(st.changed, left)
