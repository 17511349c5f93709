"""Save-decision policies: should the trainer save at this step?

``Client(job, policy=...)`` (default: ``Goodput()``, client/goodput.py) and
``client.should_save(step)`` in the training loop replace a hand-tuned checkpoint
period. A policy sees a
:class:`SaveContext` (no clock reads of its own, so each is a table-driven
test); the client adds backpressure on top: ``should_save`` is False while the
daemon has no staging memory or disk space for another save.

Where ckptd differs from Orbax's ``ContinuousCheckpointingPolicy``: Orbax waits
until the previous save has been committed to its final storage (the bucket,
for a GCS path), and its ``save()`` blocks while one is in flight. Here the
previous save only has to reach ``stage`` ("local" by default: renamed into
the node's NVMe tier), so the next save may start while the drain still
uploads the previous one, which the drain then coalesces (newest first).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FailureHistory:
    """What the daemon has seen of this job's failures (daemon/api/history.py)."""

    observed_seconds: float
    """The job's active time on this node (daemon/api/history.py)."""
    restarts: int
    """Trainer restarts (processes that restored the job's steps) in that time."""
    restart_ages: tuple[float, ...] = ()
    """Seconds since each of the newest restarts, newest first (at most 32)."""
    fleet_observed_seconds: float = 0.0
    """Every other job's active time on this node, summed (the prior's record)."""
    fleet_restarts: int = 0
    """Their restarts, summed."""
    node_observed_seconds: float = 0.0
    """The node names' record in the bucket (this node's and a sample of others'):
    seconds since each was first claimed, summed (0: no bucket)."""
    node_replacements: int = 0
    """How often those names' nodes were lost and replaced by a new disk, summed."""
    job_nodes: int = 1
    """Nodes the job spans (the client's ranks over the ranks on this node): a job
    loses one of its nodes that many times as often."""


def _no_history() -> FailureHistory | None:
    return None


@dataclass(frozen=True)
class SaveContext:
    """What a policy may look at when deciding about ``step``."""

    step: int
    now: float
    """Monotonic seconds (``time.monotonic()``)."""
    last_step: int | None
    """The step of this client's previous save (None: no save yet)."""
    last_save_at: float | None
    """Monotonic time the previous save started."""
    previous_reached: Callable[[str], bool]
    """Whether the previous save has reached a stage ("local" / "durable") or ended
    for good (failed, superseded); True when there was none. Asks the daemon, so
    policies call it only when the answer matters."""
    history: Callable[[], FailureHistory | None] = _no_history
    """The daemon's record of this job's restarts (None where it has none); asks
    the daemon the first time only."""
    previous_uploaded: Callable[[], bool] = lambda: True
    """Whether the previous save reached DURABLE itself (not skipped by the upload
    pace or coalescing); meaningful once ``previous_reached("durable")``."""


class SavePolicy(ABC):
    """Decides whether to save at a step."""

    @abstractmethod
    def should_save(self, ctx: SaveContext) -> bool:
        """True to save at ``ctx.step``."""


@dataclass(frozen=True)
class Continuous(SavePolicy):
    """Save as soon as the previous save has reached ``stage`` and, if set,
    ``min_interval_seconds`` have passed since it started.

    ``stage="memory"``: every step (the previous save was acknowledged when its
    ``save()`` returned: it is in the daemon's shared memory, safe from a trainer
    or daemon crash). When saves arrive faster than the local disk writes them,
    the daemon writes the newest it can and the ones in between end SUPERSEDED
    (``supersede_unwritten``), so the trainer does not wait for the disk."""

    min_interval_seconds: float | None = None
    stage: str = "local"

    def __post_init__(self) -> None:
        if self.stage not in ("memory", "local", "durable"):
            raise ValueError(f"stage must be 'memory', 'local' or 'durable', not {self.stage!r}")
        if self.min_interval_seconds is not None and self.min_interval_seconds < 0:
            raise ValueError("min_interval_seconds must be >= 0 or None")

    def should_save(self, ctx: SaveContext) -> bool:
        if ctx.last_save_at is None:
            return True
        if (
            self.min_interval_seconds is not None
            and ctx.now - ctx.last_save_at < self.min_interval_seconds
        ):
            return False
        return self.stage == "memory" or ctx.previous_reached(self.stage)


@dataclass(frozen=True)
class FixedInterval(SavePolicy):
    """Save every ``steps`` steps (at multiples of it)."""

    steps: int

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be a positive int, not {self.steps!r}")

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.steps == 0


class SpecificSteps(SavePolicy):
    """Save at exactly these steps."""

    def __init__(self, steps: Iterable[int]) -> None:
        self.steps = frozenset(int(s) for s in steps)

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step in self.steps

    def __repr__(self) -> str:
        return f"SpecificSteps({sorted(self.steps)})"


class AnyOf(SavePolicy):
    """Save if any of ``policies`` would."""

    def __init__(self, policies: Sequence[SavePolicy]) -> None:
        if not policies or not all(isinstance(p, SavePolicy) for p in policies):
            raise ValueError("AnyOf takes a non-empty list of save policies")
        self.policies = tuple(policies)

    def should_save(self, ctx: SaveContext) -> bool:
        return any(p.should_save(ctx) for p in self.policies)

    def __repr__(self) -> str:
        return f"AnyOf({list(self.policies)!r})"


__all__ = [
    "AnyOf",
    "Continuous",
    "FailureHistory",
    "FixedInterval",
    "SaveContext",
    "SavePolicy",
    "SpecificSteps",
]
