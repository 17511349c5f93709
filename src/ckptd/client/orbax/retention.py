"""The Orbax manager's retention knobs as the job's ckptd retention (the daemon's
policy language, daemon/retention/policies.py; applied in every tier by
retention/jobs.py), so ``all_steps()`` lists what exists.

``CheckpointManagerOptions`` map as Orbax's own manager reads them
(``_get_default_preservation_policy``): ``keep_period`` -> ``KeepEverySteps``,
``keep_time_interval`` -> ``KeepEverySeconds``, ``best_fn``/``best_mode`` with
``max_to_keep`` -> ``KeepBest`` of the score ``best_fn`` gives each save's metrics
(computed here and sent as the metric ``orbax_best``), else ``max_to_keep`` ->
``KeepLatest``; a ``preservation_policy`` object (``LatestN``, ``EveryNSteps``,
``EveryNSeconds``, ``CustomSteps``, ``BestN``, ``PreserveAll``,
``AnyPreservationPolicy``) maps one for one. Options left at Orbax's defaults
(keep every step: no ``max_to_keep``, or ``LatestN(None)``, the form MaxText
passes without ``max_num_checkpoints_to_keep``) leave the job on the node's
policy: ckptd's operator decides until the trainer says otherwise. A policy with no ckptd equivalent
(``LatestDuration``, ``EveryNStepsClosest``, a custom class) is said at WARNING
and leaves the node's policy too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ckptd.client.orbax")

SCORE = "orbax_best"
"""The metric name of ``best_fn``'s score (``orbax_best_1``... for further ones)."""


class Unmapped(ValueError):
    """An Orbax policy ckptd's retention has no equivalent of."""


class Retention:
    """The job's policy text (None: the node's) and how to score each save."""

    def __init__(self, options: Any) -> None:
        self.scorers: list[tuple[str, Callable[[Any], Any]]] = []
        self.best: tuple[str, str] | None = None
        """(metric, "min" or "max") of the first best policy, for ``best_step``."""
        try:
            self.text = self._of_options(options)
        except Unmapped as exc:
            log.warning("%s; the node's retention keeps this job's steps", exc)
            self.text, self.scorers, self.best = None, [], None

    def scores(self, metrics: Any) -> dict[str, float]:
        """Each ``best_fn``'s score of a save's metrics (none without metrics)."""
        out: dict[str, float] = {}
        if metrics is None:
            return out
        for name, fn in self.scorers:
            try:
                value = float(fn(metrics))
            except Exception as exc:  # Orbax would fail later, at its own cleanup
                log.warning("best_fn(metrics) failed (%s): the step has no %s", exc, name)
                continue
            if not math.isnan(value):
                out[name] = value
        return out

    def _of_options(self, options: Any) -> str | None:
        policy = getattr(options, "preservation_policy", None)
        if policy is not None and type(policy).__name__ == "LatestN" and policy.n is None:
            return None  # Orbax's default form (MaxText's with no limit): keep every step
        if policy is not None:
            return self._of_policy(policy)
        parts: list[str] = []
        if getattr(options, "keep_period", None) is not None:
            parts.append(f"KeepEverySteps({int(options.keep_period)})")
        interval = getattr(options, "keep_time_interval", None)
        if interval is not None:
            parts.append(f"KeepEverySeconds({int(interval.total_seconds())})")
        n = getattr(options, "max_to_keep", None)
        if getattr(options, "best_fn", None) is not None:
            mode = "min" if getattr(options, "best_mode", "max") == "min" else "max"
            keep = bool(getattr(options, "keep_checkpoints_without_metrics", True))
            parts.append(self._best(options.best_fn, n, mode, keep))
        elif n is not None:
            parts.append(f"KeepLatest({int(n)})")
        if not parts:
            return None  # Orbax's default keeps every step: the operator's policy
        return parts[0] if len(parts) == 1 else f"KeepAny([{', '.join(parts)}])"

    def _best(self, fn: Callable[[Any], Any], n: Any, mode: str, keep: bool) -> str:
        name = SCORE if not self.scorers else f"{SCORE}_{len(self.scorers)}"
        self.scorers.append((name, fn))
        if self.best is None:
            self.best = (name, mode)
        if n is None:
            return "KeepAll()"
        return f"KeepBest({name!r}, {int(n)}, {mode!r}, keep_without_metric={keep})"

    def _of_policy(self, policy: Any) -> str:
        kind = type(policy).__name__
        if kind == "PreserveAll":
            return "KeepAll()"
        if kind == "LatestN":
            return "KeepAll()" if policy.n is None else f"KeepLatest({int(policy.n)})"
        if kind == "EveryNSeconds":
            return f"KeepEverySeconds({int(policy.interval_secs)})"
        if kind == "EveryNSteps" and getattr(policy, "exact_interval", True):
            if getattr(policy, "max_to_keep", None) is not None:
                raise Unmapped("EveryNSteps(max_to_keep=...) has no ckptd equivalent")
            return f"KeepEverySteps({int(policy.interval_steps)})"
        if kind == "CustomSteps":
            return f"KeepSteps({sorted(int(s) for s in policy._steps_set)})"
        if kind == "BestN":
            mode = "min" if policy.reverse else "max"
            keep = bool(policy.keep_checkpoints_without_metrics)
            return self._best(policy.get_metric_fn, policy.n, mode, keep)
        if kind == "AnyPreservationPolicy":
            return f"KeepAny([{', '.join(self._of_policy(p) for p in policy.policies)}])"
        raise Unmapped(f"Orbax's preservation policy {policy!r} has no ckptd equivalent")


__all__ = ["SCORE", "Retention"]
