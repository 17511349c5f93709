"""The retention plan of each job, read from the catalog: the one source the drain,
the evictor and ``ckptd ls`` share (what each tier keeps, and why)."""

from __future__ import annotations

import time
from collections.abc import Callable

from ckptd.proto import ckptd_pb2 as pb

from ..catalog import Step
from ..catalog.roles import Steps
from .jobs import JobRetention
from .plan import Plan, StepView, plan_job
from .policies import Policy

__all__ = ["READ_GRACE_SECONDS", "JobRetention", "Retention"]

READ_GRACE_SECONDS = 120.0
"""A step served by Restore is not evicted for this long: the client may still open it."""


class Retention:
    """The configured policies of both tiers, applied to the catalog's steps."""

    def __init__(
        self,
        catalog: Steps,
        local_policy: Policy,
        remote_policy: Policy | None,
        *,
        evict_unuploaded: bool = False,
        jobs: JobRetention | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.catalog = catalog
        self.local_policy = local_policy
        self.remote_policy = remote_policy
        """None without a remote tier."""
        self.evict_unuploaded = evict_unuploaded
        self.jobs = jobs if jobs is not None else JobRetention(None)
        """The jobs' own policies, set by their trainers (jobs.py)."""
        self._clock = clock
        self.retracting: set[tuple[str, int]] = set()
        """Steps the evictor is taking out of the bucket right now: the drain counts
        them out of it already (lifecycle/holders.py)."""

    def busy(self, st: Step) -> bool:
        """Being uploaded, fetched or read right now: no tier may drop it."""
        return (
            st.busy > 0
            or st.state == pb.SAVE_STATE_DRAINING
            or self.catalog.read_recently(st, READ_GRACE_SECONDS)
        )

    def view(self, st: Step) -> StepView:
        """What the plan sees of one step."""
        return StepView(
            step=st.step,
            time=st.time,
            milestone=st.milestone,
            metrics=st.metrics,
            pinned=st.pinned,
            local=st.local,
            remote=self.catalog.node_id in st.remote_nodes,
            pending=st.state in (pb.SAVE_STATE_LOCAL, pb.SAVE_STATE_DRAINING),
            busy=self.busy(st),
            healthy=st.healthy,
            abandoned=st.abandoned,
            timeline=st.timeline,
            holders=self.catalog.references(st),
        )

    def plan(self, job: str) -> Plan:
        """The current plan for one job."""
        views = [self.view(s) for s in self.catalog.list(job)]
        local, remote = self.jobs.tiers(job, self.local_policy, self.remote_policy)
        return plan_job(
            views,
            local,
            remote,
            self._clock(),
            evict_unuploaded=self.evict_unuploaded,
            abandoned=self.jobs.abandoned(job, self.local_policy, self.remote_policy),
        )
