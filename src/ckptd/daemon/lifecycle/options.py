"""The lifecycle's configuration keys, declared here once (see local/options.py):
retention in each tier, the drain's pauses, adoption."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..retention.policies import Policy, parse_policy


@dataclass(frozen=True)
class LifecycleOptions:
    """What the background services (the drain, the evictor, the adopter) are
    configured with."""

    retention_local: Policy = field(default_factory=lambda: parse_policy("KeepLatest(3)"))
    """Which checkpoints the local tier keeps (see daemon/retention/policies.py)."""
    retention_remote: Policy = field(
        default_factory=lambda: parse_policy("KeepAny([KeepLatest(3), KeepMilestones()])")
    )
    """Which checkpoints the remote tier keeps; milestones are always kept there."""
    job_retention: bool = True
    """Let a job's trainer set the job's retention (``Client.set_retention``: the
    framework's ``max_to_keep``, ``keep_latest_k``, ``save_total_limit``, best
    checkpoints), applied in every tier in place of the policies above
    (retention/jobs.py). Off: every job keeps the node's policies."""
    job_retention_max_steps: int = 0
    """Most steps a job's own retention keeps in a tier (the newest of those it
    keeps; milestones and pins apart); 0: no limit."""
    job_retention_floor: Policy = field(default_factory=lambda: parse_policy("KeepSteps([])"))
    """What the durable tier keeps of every job whatever its own retention says
    (e.g. KeepEverySteps(5000)); the default keeps nothing more."""
    local_evict_unuploaded: bool = False
    """Let the local retention evict a copy whose remote copy is not complete yet
    (milestones excepted). Off: such copies wait for the drain."""
    drain_retry_max_seconds: float = 30.0
    """Longest pause between retries of a transient remote error (backoff doubles up to it);
    also the first pause before a failed upload is tried again (doubling to ten minutes)."""
    drain_stall_seconds: float = 45.0
    """An upload with no file finished for this long shows as the drain's error in
    status (a store that hangs without answering)."""
    adopt_poll_seconds: float = 0.25
    """How often watched directories (a job's Orbax directory) are scanned for
    finished steps to adopt."""
    adopt_dirs: tuple[Path, ...] = ()
    """Directories (absolute; symlinks resolved at start-up) in which Adopt, Watch and
    EnsureLocal may act, on files the calling process could read or write itself.
    Empty: only each job's own Orbax directory under the root (``<root>/.orbax/<job>``)."""
