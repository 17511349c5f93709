"""A one-rank manifest of job ``j`` on node ``node-a``, for the lifecycle unit tests."""

from __future__ import annotations

from ckptd.core.manifest import Manifest, RankRecord

NODE = "node-a"


def manifest(step: int, timeline: int) -> Manifest:
    """Step ``step`` of timeline ``timeline`` (a later timeline forked at step 0)."""
    return Manifest(
        job="j",
        step=step,
        node=NODE,
        world_size=1,
        created_unix=1.0,
        ranks=[RankRecord(0, "rank-00000.safetensors", 4096, 7, None)],
        timeline=timeline,
        forks=((1, 0),) if timeline else (),
    )
