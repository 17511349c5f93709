"""The evictor's decisions for one job, as a pure function of what each tier holds.

Safety rules on top of the tiers' policies (docs/architecture.md, "Retention safety
rules"):

- the newest complete checkpoint of a job in a tier is never evicted from it,
  whatever the policy (``KeepLatest(0)`` included);
- pinned steps are never evicted from any tier;
- while a tier's newer steps hold NaN/Inf, its newest step known to hold none is
  kept (``last-known-good``): a run that diverged and kept saving still has the
  step to go back to (core/health.py);
- a local copy whose remote copy is not complete is kept while the remote tier
  may still want it (``awaiting-upload``), unless the operator opted in with
  ``local_evict_unuploaded``. Milestones are always wanted by the remote tier,
  so a milestone leaves the local tier only once its remote copy is complete
  (without a remote tier, never);
- steps being uploaded, fetched or read are not touched (``in-use``).

Abandoned steps (core/timeline.py: above the point a later timeline forked at)
are planned apart from the job's live history, each abandoned timeline on its
own: the durable tier (the bucket; the local tier when there is none) keeps what
its policy keeps of that timeline (its latest, milestones, best), so a rollback
or a reused job name never loses the older run's kept copies. Below a bucket,
the local tier drops them (the disk is for the live run) once the live history's
newest step has a complete copy, except pinned ones and those the bucket still
wants uploaded (``awaiting-upload``). Their reasons say ``abandoned``.

"Pending" steps wait for the drain. The remote policy applied to the remote
tier plus the pending steps says which of them the bucket will want: the drain
uploads only those, and a pending step it will not want becomes SUPERSEDED once
a newer step is complete remotely.

References come last (references.py): a step that a step a tier keeps (or one in
use, or one waiting to go up) references stays in that tier, whatever the above
said (``referenced-by-step-N``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .policies import Checkpoint, KeepAny, KeepMilestones, Kept, Policy
from .references import holders_lookup, keep_referenced, referenced


@dataclass(frozen=True)
class StepView:
    """What the evictor knows about one step of a job."""

    step: int
    time: float
    milestone: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    pinned: bool = False
    local: bool = False
    """A complete local copy exists."""
    remote: bool = False
    """This node's part is complete in the bucket (its marker is there)."""
    pending: bool = False
    """Local, waiting for (or in) the drain."""
    busy: bool = False
    """Being uploaded, fetched or restored right now."""
    healthy: bool | None = None
    """No NaN/Inf (True), some (False), not counted (None)."""
    abandoned: bool = False
    """Left behind by a later timeline (core/timeline.py)."""
    timeline: int = 0
    holders: frozenset[int] = frozenset()
    """The older steps whose rank files this step's references read (its manifest's,
    or the bucket index's once the local copy is gone)."""

    def checkpoint(self) -> Checkpoint:
        """The policy-facing view."""
        return Checkpoint(self.step, self.time, self.milestone, self.metrics)


@dataclass
class Plan:
    """What to do for one job, and why each copy stays."""

    evict_local: list[int] = field(default_factory=list)
    evict_remote: list[int] = field(default_factory=list)
    supersede: list[int] = field(default_factory=list)
    """Pending steps the bucket will not want (a newer step is complete there)."""
    remote_wants: set[int] = field(default_factory=set)
    """Pending steps the drain should upload."""
    pressure: list[int] = field(default_factory=list)
    """Local copies that may go when disk space is short, oldest first: kept by the
    local policy, but complete in the bucket, not pinned, not the newest."""
    local_reasons: dict[int, list[str]] = field(default_factory=dict)
    remote_reasons: dict[int, list[str]] = field(default_factory=dict)


def _kept(policy: Policy, views: Sequence[StepView], now: float) -> Kept:
    kept = policy.keep([v.checkpoint() for v in views], now)
    if views:
        newest = max(v.step for v in views)
        kept.setdefault(newest, set()).add("newest")
    for v in views:
        if v.pinned:
            kept.setdefault(v.step, set()).add("pinned")
    good = max((v.step for v in views if v.healthy), default=None)
    if good is not None and any(v.healthy is False and v.step > good for v in views):
        kept.setdefault(good, set()).add("last-known-good")
    return kept


def plan_job(
    views: Sequence[StepView],
    local_policy: Policy,
    remote_policy: Policy | None,
    now: float,
    *,
    evict_unuploaded: bool = False,
    abandoned: tuple[Policy, Policy | None] | None = None,
) -> Plan:
    """Decide evictions for one job. ``remote_policy`` is None without a remote tier;
    ``abandoned``: the (local, remote) policies of its abandoned timelines, if not
    those of its live history."""
    plan = Plan()
    live = [v for v in views if not v.abandoned]
    _plan_live(plan, live, local_policy, remote_policy, now, evict_unuploaded)
    # The live history has a complete newest step: abandoned local copies may go.
    top = max(live, key=lambda v: v.step, default=None)
    ready = top is None or top.local or top.remote
    old_local, old_remote = abandoned or (local_policy, remote_policy)
    for timeline in sorted({v.timeline for v in views if v.abandoned}):
        group = [v for v in views if v.abandoned and v.timeline == timeline]
        _plan_abandoned(plan, group, old_local, old_remote, now, ready)
    _plan_references(plan, views)
    return plan


def _plan_references(plan: Plan, views: Sequence[StepView]) -> None:
    """Each tier keeps what the steps it keeps reference (references.py): the bucket's
    uploads first (they decide what stays pending), then its copies, then the disk's."""
    holders_of = holders_lookup({v.step: v.holders for v in views if v.holders})
    if not any(v.holders for v in views):
        return  # no incremental step: nothing to add (the common case stays as cheap)
    busy = [v.step for v in views if v.busy]
    supersede = set(plan.supersede)
    going = [v.step for v in views if v.pending and not v.remote and v.step not in supersede]
    upload = {v.step for v in views if v.local and not v.remote}
    for step in referenced([*going, *busy], holders_of):
        if step in upload:  # the bucket needs it first: it goes up, never SUPERSEDED
            plan.remote_wants.add(step)
            if step in supersede:
                plan.supersede.remove(step)
    remote = {v.step for v in views if v.remote}
    evict_remote = set(plan.evict_remote)
    keep_referenced(
        plan.evict_remote,
        plan.remote_reasons,
        remote,
        [*(s for s in remote if s not in evict_remote), *busy, *going],
        holders_of,
    )
    local = {v.step for v in views if v.local}
    evict_local = set(plan.evict_local)
    needed = keep_referenced(
        plan.evict_local,
        plan.local_reasons,
        local,
        [*(s for s in local if s not in evict_local), *busy],
        holders_of,
    )
    # Disk pressure never takes a copy a kept copy reads: the referencing step goes
    # first (it is newer), and the holder at the next pass, once nothing needs it.
    plan.pressure = [s for s in plan.pressure if s not in needed]


def _plan_live(
    plan: Plan,
    views: Sequence[StepView],
    local_policy: Policy,
    remote_policy: Policy | None,
    now: float,
    evict_unuploaded: bool,
) -> None:
    """The job's live history: its tiers' policies and the safety rules."""
    local = [v for v in views if v.local]
    remote = [v for v in views if v.remote]
    local_kept = _kept(local_policy, local, now)
    remote_kept: Kept = {}
    future_kept: Kept = {}
    if remote_policy is not None:
        # The remote tier always keeps milestones, whatever its configured policy.
        wants = KeepAny((remote_policy, KeepMilestones()))
        remote_kept = _kept(wants, remote, now)
        future = remote + [v for v in views if v.pending and not v.remote]
        future_kept = _kept(wants, future, now)
    newest_remote = max((v.step for v in remote), default=-1)
    # Local-only steps the bucket will never want: a newer step is complete there
    # and the remote policy would not keep them (failed uploads included).
    superseded: set[int] = set()
    for v in views:
        if v.local and not v.remote and remote_policy is not None:
            if v.step in future_kept:
                if v.pending:
                    plan.remote_wants.add(v.step)
            elif v.step < newest_remote:
                superseded.add(v.step)
                if v.pending:
                    plan.supersede.append(v.step)
    for v in sorted(local, key=lambda v: v.step):
        reasons = local_kept.get(v.step)
        if reasons:
            plan.local_reasons[v.step] = sorted(reasons)
            if v.remote and not v.busy and not ({"newest", "pinned"} & reasons):
                plan.pressure.append(v.step)
            continue
        held = _local_hold(v, remote_policy is not None, superseded, evict_unuploaded)
        if held:
            plan.local_reasons[v.step] = [held]
        else:
            plan.evict_local.append(v.step)
    for v in sorted(remote, key=lambda v: v.step):
        reasons = remote_kept.get(v.step)
        if reasons:
            plan.remote_reasons[v.step] = sorted(reasons)
        elif v.busy:
            plan.remote_reasons[v.step] = ["in-use"]
        else:
            plan.evict_remote.append(v.step)


def _plan_abandoned(
    plan: Plan,
    views: Sequence[StepView],
    local_policy: Policy,
    remote_policy: Policy | None,
    now: float,
    ready: bool,
) -> None:
    """One abandoned timeline: the durable tier keeps what its policy keeps of it; a
    local tier below a bucket keeps only what must stay until then."""
    if remote_policy is None:  # the local tier is the durable one
        kept = _kept(KeepAny((local_policy, KeepMilestones())), views, now)
        for v in sorted(views, key=lambda v: v.step):
            reasons = kept.get(v.step) or ({"in-use"} if v.busy else set())
            if reasons:
                plan.local_reasons[v.step] = ["abandoned", *sorted(reasons)]
            else:
                plan.evict_local.append(v.step)
        return
    remote = [v for v in views if v.remote]
    wants = KeepAny((remote_policy, KeepMilestones()))
    remote_kept = _kept(wants, remote, now)
    future_kept = _kept(wants, remote + [v for v in views if v.pending and not v.remote], now)
    for v in sorted(views, key=lambda v: v.step):
        if v.local:
            held = ""
            if v.pinned:
                held = "pinned"
            elif v.busy:
                held = "in-use"
            elif not ready:
                held = "until-the-new-timeline-commits"
            elif not v.remote and v.step in future_kept:
                held = "awaiting-upload"
            if held:
                plan.local_reasons[v.step] = ["abandoned", held]
            else:
                plan.evict_local.append(v.step)
        if v.pending and not v.remote:
            if v.step in future_kept:
                plan.remote_wants.add(v.step)
            else:
                plan.supersede.append(v.step)  # the bucket never wants it
        if v.remote:
            kept_for = remote_kept.get(v.step)
            if kept_for:
                plan.remote_reasons[v.step] = ["abandoned", *sorted(kept_for)]
            elif v.busy:
                plan.remote_reasons[v.step] = ["abandoned", "in-use"]
            else:
                plan.evict_remote.append(v.step)


def _local_hold(v: StepView, has_remote: bool, superseded: set[int], evict_unuploaded: bool) -> str:
    """Why a local copy the local policy does not keep must stay anyway ("" if it may go)."""
    if v.busy:
        return "in-use"
    if not has_remote:
        # The local tier is the durable one: it keeps milestones like a bucket would.
        return "milestone" if v.milestone else ""
    if v.remote or v.step in superseded:
        return ""
    if v.milestone:
        return "awaiting-upload"  # a milestone's only copy, even with the opt-in
    return "" if evict_unuploaded else "awaiting-upload"
