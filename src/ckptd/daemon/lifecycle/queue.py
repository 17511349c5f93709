"""The drain's queue: what this node's index already holds, and what goes up next.

A job's steps are matched against this node's index in the bucket once per daemon
life (one GET): at start-up for the jobs held locally, and before the first upload
of any other job (taken back from a peer after a node loss, or first saved since).
Until then a step cannot tell a later save under its number in the bucket from the
copy it replaced. The upload order is newest first and coalescing: each job's
newest pending step, then older steps the remote retention keeps.
"""

from __future__ import annotations

from ckptd.proto import ckptd_pb2 as pb

from ..catalog import Catalog, Step
from ..remote.index import NodeIndex
from ..remote.own import learn_own
from ..retention.planner import Retention
from .pace import UploadPace


async def match(catalog: Catalog, index: NodeIndex, job: str) -> int:
    """Tell ``catalog`` the steps of ``job`` this node's index records (read once);
    how many (remote/own.py)."""
    return len(await learn_own(catalog, index, job))


def supersede_unwanted(catalog: Catalog, retention: Retention, node_id: str) -> None:
    """Pending steps the bucket will never want become SUPERSEDED: a newer step of
    their job is complete there and the remote retention does not keep them."""
    for job in catalog.jobs():
        supersede = retention.plan(job).supersede
        if not supersede:
            continue
        newest = next((s.step for s in catalog.list(job) if node_id in s.remote_nodes), -1)
        for step in supersede:
            st = catalog.get(job, step)
            if st is not None and st.state == pb.SAVE_STATE_LOCAL:
                catalog.superseded(
                    st,
                    f"superseded by step {newest}, uploaded first (coalescing drain); "
                    "the remote retention does not keep this step",
                )


def pick(catalog: Catalog, retention: Retention, pace: UploadPace, node_id: str) -> Step | None:
    """Each job's newest pending step first (most recently committed job first), then
    older steps the remote retention keeps, newest first."""
    by_job: dict[str, list[Step]] = {}
    for s in catalog.steps():
        if s.state == pb.SAVE_STATE_LOCAL and s.local and not s.busy:
            by_job.setdefault(s.job, []).append(s)
    newest = [max(steps, key=lambda s: s.order) for steps in by_job.values()]
    fresh = [s for s in newest if not newer_in_remote(catalog, s, node_id) and pace.ready(s.job)]
    if fresh:
        return max(fresh, key=lambda s: s.local_at)
    older = [
        s
        for job, steps in by_job.items()
        for s in steps
        if s.step in retention.plan(job).remote_wants and (s.milestone or not pace.interval(job))
    ]
    return max(older, key=lambda s: s.order) if older else None


def newer_in_remote(catalog: Catalog, st: Step, node_id: str) -> bool:
    """Whether a later step of ``st``'s job holds this node's copy in the bucket."""
    return any(s.order > st.order and node_id in s.remote_nodes for s in catalog.list(st.job))
