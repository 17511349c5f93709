"""This node's own steps of a job in the bucket, from its index, told to the catalog.

What a refresh starts from (source.py), what the drain matches a job against before
its first upload of it (lifecycle/queue.py), and what a job's first save here reads
before its timeline is chosen. One GET per job in a daemon's life (index.py keeps
it current afterwards).
"""

from __future__ import annotations

from ..catalog.roles import Copies
from .index import Entry, NodeIndex


async def learn_own(catalog: Copies, index: NodeIndex, job: str) -> dict[int, Entry]:
    """The steps of ``job`` this node's index records, each told to ``catalog`` (a
    local copy a later save in the bucket replaced gives way: timelines.outdated).
    An entry flagged ``retracting`` is no copy: left out (the drain finishes it)."""
    entries = {n: e for n, e in (await index.entries(job)).items() if not e.retracting}
    for e in entries.values():
        catalog.discovered(
            job,
            e.step,
            {catalog.node_id},
            e.adopted,
            pinned=e.pinned,
            created_unix=e.created_unix,
            milestone=e.milestone,
            metrics=e.metrics,
            timeline=e.timeline,
            forks=e.forks,
            holders=frozenset(e.holders),
        )
    return entries
