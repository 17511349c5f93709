"""Domain objects -> wire messages (the servicer's replies)."""

from __future__ import annotations

from ckptd.core.format import ALIGN
from ckptd.core.redact import redact
from ckptd.proto import ckptd_pb2 as pb

from ..catalog import Event, Step
from ..local.staging import Lease
from ..retention.plan import Plan


def checkpoint_info(st: Step, plan: Plan | None) -> pb.CheckpointInfo:
    """One row of ``ListCheckpoints``."""
    m = st.manifest
    return pb.CheckpointInfo(
        local_reasons=plan.local_reasons.get(st.step, []) if plan else [],
        remote_reasons=plan.remote_reasons.get(st.step, []) if plan else [],
        pinned=st.pinned,
        metrics=st.metrics,
        adopted=st.adopted,
        source=m.source if m else "",
        job=st.job,
        step=st.step,
        state=st.state,  # type: ignore[arg-type]
        # The memory tier only here (`ckptd ls`): events and save states follow the
        # lifecycle, which a copy kept in memory is not part of.
        tiers=[pb.TIER_MEMORY] * st.in_memory + st.tiers(),
        # A bucket-only step has no local manifest: its time is the one its index entry
        # or marker recorded (the catalog's), never 0 (1970 in every listing).
        created_unix=m.created_unix if m else st.time,
        size_bytes=m.size_bytes if m else 0,
        num_shards=len(m.shards) if m else 0,
        milestone=st.milestone,
        error=redact(st.error or (f"unusable: {st.unusable}" if st.unusable else "")),
        timeline=st.timeline,
        abandoned=st.abandoned,
    )


def save_status(st: Step, wait_for: int, ranks_written: list[int]) -> pb.SaveStatus:
    """The reply of ``GetSaveStatus``."""
    return pb.SaveStatus(
        job=st.job,
        step=st.step,
        state=st.state,  # type: ignore[arg-type]
        error=redact(st.error),
        ranks_committed=ranks_written,
        node_ranks=list(st.node_ranks),
        handoff_to_local_seconds=max(0.0, st.local_at - st.handoff_at) if st.local_at else 0.0,
        handoff_to_durable_seconds=(
            max(0.0, st.durable_at - st.handoff_at) if st.durable_at else 0.0
        ),
        reached=st.reached(wait_for) if wait_for else False,
        final=st.final(wait_for) if wait_for else False,
        tiers=st.tiers(),
    )


def lease(lease: Lease) -> pb.Lease:
    """A granted lease."""
    return pb.Lease(
        lease_id=lease.lease_id,
        segment=lease.segment.name,
        size_bytes=lease.segment.size,
        alignment=ALIGN,
        holds_image=lease.holds is not None,
        holds_step=lease.holds or 0,
        waits_for_word=True,
    )


def event(e: Event) -> pb.EventRecord:
    """One catalog event."""
    return pb.EventRecord(
        seq=e.seq,
        time_unix=e.time,
        kind=e.kind,  # type: ignore[arg-type]
        job=e.job,
        step=e.step,
        state=e.state,  # type: ignore[arg-type]
        tiers=list(e.tiers),  # type: ignore[arg-type]
        detail=redact(e.detail),
        attributes=dict(e.attributes),
    )
