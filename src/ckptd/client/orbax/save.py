"""What ckptd's Orbax manager decides and copies at a save.

- The save decision: Orbax's own policy objects (what ``CheckpointManagerOptions``
  builds in Orbax's manager, or the ``save_decision_policy`` given), asked with a
  ``DecisionContext`` of ckptd's state.
- The snapshot on an accelerator: before ``save()`` returns, every jax leaf is put
  in pinned host memory (``jax.device_put``, asynchronous, as Orbax's own save
  does), so the trainer may donate its arrays at once and the copy into the
  daemon's shared memory runs after ``save()`` returned. On CPU the arrays are
  already in host memory and are copied into shared memory before ``save()``
  returns (no second copy).
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Any

import jax

from .items import ocp

policies = ocp.checkpoint_managers
"""Orbax's save decision policies (the ones MaxText configures decide here too)."""
_CONTEXT_FIELDS = {f.name for f in dataclasses.fields(policies.DecisionContext)}
"""What this Orbax's ``DecisionContext`` takes (its fields grew across 0.12.x)."""


@dataclass(frozen=True)
class StepInfo:
    """A step as Orbax's save decision policies see it (``PolicyCheckpointInfo``)."""

    step: int
    time: datetime.datetime
    metrics: dict[str, Any] | None = None


def now() -> datetime.datetime:
    """The time a policy compares steps by (UTC, as Orbax's)."""
    return datetime.datetime.now(tz=datetime.UTC)


def decision_policy(options: Any) -> Any:
    """The policy Orbax's manager would use for ``options`` (its defaults included)."""
    if options.save_decision_policy is not None:
        return options.save_decision_policy
    chosen: list[Any] = []
    if options.should_save_fn is not None:
        chosen.append(_ShouldSaveFn(options.should_save_fn))
    else:
        if options.save_interval_steps is not None:
            chosen.append(policies.FixedIntervalPolicy(options.save_interval_steps))
        if options.save_on_steps is not None:
            chosen.append(policies.SpecificStepsPolicy(options.save_on_steps))
    chosen.append(policies.PreemptionCheckpointingPolicy())
    if options.should_save_fn is None:
        chosen.append(policies.InitialSavePolicy())
    return policies.AnySavePolicy(chosen)


def decision_context(saving: bool, preempted: bool, options: Any) -> Any:
    """Orbax's ``DecisionContext`` (only the fields this Orbax version has)."""
    known = {
        "is_saving_in_progress": saving,
        "reached_preemption": preempted,
        "multiprocessing_options": options.multiprocessing_options,
    }
    return policies.DecisionContext(**{k: v for k, v in known.items() if k in _CONTEXT_FIELDS})


@dataclass
class _ShouldSaveFn:
    """``CheckpointManagerOptions.should_save_fn`` as a save decision policy."""

    fn: Any

    def should_save(self, step: Any, previous_steps: Any, *, context: Any) -> bool:
        return bool(self.fn(step.step, previous_steps[-1].step if previous_steps else None))


def off_device(tree: Any) -> Any | None:
    """``tree`` with each jax leaf on its way to pinned host memory (new arrays the
    trainer cannot donate; typed PRNG keys, which have no host form, copied on the
    device); None where the arrays are already in host memory (CPU devices) or
    this backend has no pinned host memory."""
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]
    if not leaves:
        return None
    devices: set[Any] = {d for x in leaves for d in x.sharding.device_set}
    if any(d.platform == "cpu" for d in devices) or not all(_pinned(d) for d in devices):
        return None

    def one(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
            return x.copy()
        return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))

    return jax.tree_util.tree_map(one, tree)


def _pinned(device: Any) -> bool:
    try:
        return any(m.kind == "pinned_host" for m in device.addressable_memories())
    except Exception:  # a backend without memory kinds
        return False


__all__ = ["StepInfo", "decision_context", "decision_policy", "now", "off_device", "policies"]
