"""Retention policies: which checkpoints a tier keeps. Pure: no clock, no I/O.

A policy looks at the complete checkpoints of one job in one tier and returns
the steps it keeps, each with the reasons (``latest``, ``every-10-steps``,
``milestone``, ``best-loss`` ...) that ``ckptd ls`` shows. Time enters only as
the checkpoints' own creation times and the ``now`` argument, so every policy
is a table-driven unit test. The evictor (retention/evictor.py) adds the safety rules.

Policies are written in config as Python-like expressions, parsed without
``eval``::

    KeepAny([KeepLatest(3), KeepEverySteps(10), KeepMilestones()])

Orbax's names are accepted where they map: ``LatestN(n)``,
``EveryNSteps(interval_steps)``, ``EveryNSeconds(interval_secs)``,
``BestN(metric, n, reverse)``, ``CustomSteps(steps)``,
``AnyPreservationPolicy(policies)``.
"""

from __future__ import annotations

import ast
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Kept = dict[int, set[str]]
"""Step -> the reasons it is kept."""


@dataclass(frozen=True)
class Checkpoint:
    """What a policy may look at: one complete checkpoint of a job in a tier."""

    step: int
    time: float
    """Creation time (unix seconds) of the checkpoint."""
    milestone: bool = False
    metrics: Mapping[str, float] = field(default_factory=dict)


class Policy(ABC):
    """A retention policy; :meth:`keep` must not read the clock or do I/O."""

    @abstractmethod
    def keep(self, ckpts: Sequence[Checkpoint], now: float) -> Kept:
        """The steps of ``ckpts`` this policy keeps, with reasons."""

    @abstractmethod
    def describe(self) -> str:
        """The policy as it would be written in config."""

    def __repr__(self) -> str:
        return self.describe()


def _by_step(ckpts: Sequence[Checkpoint]) -> list[Checkpoint]:
    return sorted(ckpts, key=lambda c: c.step)


@dataclass(frozen=True, repr=False)
class KeepLatest(Policy):
    """The ``n`` newest steps (0 keeps none; the evictor still keeps the newest)."""

    n: int

    def keep(self, ckpts: Sequence[Checkpoint], now: float) -> Kept:
        newest = _by_step(ckpts)[::-1][: self.n] if self.n > 0 else []
        return {c.step: {"latest"} for c in newest}

    def describe(self) -> str:
        return f"KeepLatest({self.n})"


@dataclass(frozen=True, repr=False)
class KeepEverySteps(Policy):
    """Steps that are multiples of ``k`` (0, k, 2k, ...)."""

    k: int

    def keep(self, ckpts: Sequence[Checkpoint], now: float) -> Kept:
        return {c.step: {f"every-{self.k}-steps"} for c in ckpts if c.step % self.k == 0}

    def describe(self) -> str:
        return f"KeepEverySteps({self.k})"


@dataclass(frozen=True, repr=False)
class KeepEverySeconds(Policy):
    """The oldest step, then each step at least ``s`` seconds after the last kept one.

    Adding newer checkpoints never changes which older ones are kept, so an
    evicted step can never have been needed later.
    """

    s: float

    def keep(self, ckpts: Sequence[Checkpoint], now: float) -> Kept:
        kept: Kept = {}
        last: float | None = None
        for c in _by_step(ckpts):
            if last is None or c.time - last >= self.s:
                kept[c.step] = {f"every-{self.s:g}s"}
                last = c.time
        return kept

    def describe(self) -> str:
        return f"KeepEverySeconds({self.s:g})"


@dataclass(frozen=True, repr=False)
class KeepMilestones(Policy):
    """Steps saved with ``milestone=True``."""

    def keep(self, ckpts: Sequence[Checkpoint], now: float) -> Kept:
        return {c.step: {"milestone"} for c in ckpts if c.milestone}

    def describe(self) -> str:
        return "KeepMilestones()"


@dataclass(frozen=True, repr=False)
class KeepBest(Policy):
    """The ``n`` steps with the best value of ``metric`` (``mode`` "min" or "max").

    Ties go to the newer step. Steps without the metric (or with NaN) are not
    kept by this policy unless ``keep_without_metric``.
    """

    metric: str
    n: int
    mode: str = "min"
    keep_without_metric: bool = False

    def keep(self, ckpts: Sequence[Checkpoint], now: float) -> Kept:
        scored, missing = [], []
        for c in ckpts:
            value = c.metrics.get(self.metric)
            if value is None or math.isnan(value):
                missing.append(c)
            else:
                scored.append((value if self.mode == "min" else -value, -c.step, c))
        scored.sort(key=lambda t: (t[0], t[1]))
        reason = f"best-{self.metric}"
        kept: Kept = {c.step: {reason} for _, _, c in scored[: max(self.n, 0)]}
        if self.keep_without_metric:
            for c in missing:
                kept[c.step] = {f"no-{self.metric}"}
        return kept

    def describe(self) -> str:
        extra = ", keep_without_metric=True" if self.keep_without_metric else ""
        return f"KeepBest({self.metric!r}, {self.n}, {self.mode!r}{extra})"


@dataclass(frozen=True, repr=False)
class KeepSteps(Policy):
    """An explicit list of steps."""

    steps: frozenset[int]

    def keep(self, ckpts: Sequence[Checkpoint], now: float) -> Kept:
        return {c.step: {"listed"} for c in ckpts if c.step in self.steps}

    def describe(self) -> str:
        return f"KeepSteps({sorted(self.steps)})"


@dataclass(frozen=True, repr=False)
class KeepAll(Policy):
    """Every checkpoint (no retention)."""

    def keep(self, ckpts: Sequence[Checkpoint], now: float) -> Kept:
        return {c.step: {"all"} for c in ckpts}

    def describe(self) -> str:
        return "KeepAll()"


@dataclass(frozen=True, repr=False)
class KeepAny(Policy):
    """A step is kept if any of ``policies`` keeps it; the reasons are merged."""

    policies: tuple[Policy, ...]

    def keep(self, ckpts: Sequence[Checkpoint], now: float) -> Kept:
        kept: Kept = {}
        for policy in self.policies:
            for step, reasons in policy.keep(ckpts, now).items():
                kept.setdefault(step, set()).update(reasons)
        return kept

    def describe(self) -> str:
        return f"KeepAny([{', '.join(p.describe() for p in self.policies)}])"


# -- parsing -------------------------------------------------------------------
class PolicyError(ValueError):
    """A retention expression that cannot be parsed; the message says what is accepted."""


def _int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PolicyError(f"{name} must be an integer >= {minimum}, not {value!r}")
    return value


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise PolicyError(f"{name} must be a positive number, not {value!r}")
    return float(value)


def _latest(n: Any = None) -> Policy:
    return KeepAll() if n is None else KeepLatest(_int("n", n))


def _every_steps(k: Any, exact_interval: bool = True) -> Policy:
    if exact_interval is not True:
        raise PolicyError("EveryNSteps(exact_interval=False) is not supported; use KeepEverySteps")
    return KeepEverySteps(_int("k", k, 1))


def _every_seconds(s: Any) -> Policy:
    return KeepEverySeconds(_number("s", s))


def _best(metric: Any, n: Any, mode: Any = "min", keep_without_metric: Any = False) -> Policy:
    if not isinstance(metric, str) or not metric:
        raise PolicyError(f"metric must be a metric name such as 'loss', not {metric!r}")
    if mode not in ("min", "max"):
        raise PolicyError(f"mode must be 'min' or 'max', not {mode!r}")
    return KeepBest(metric, _int("n", n), mode, bool(keep_without_metric))


def _orbax_best(
    metric: Any, n: Any = None, reverse: Any = False, keep_checkpoints_without_metrics: Any = True
) -> Policy:
    # Orbax sorts ascending (descending with reverse=True) and keeps the last n:
    # reverse=False keeps the largest values.
    if n is None:
        return KeepAll()
    return _best(metric, n, "min" if reverse else "max", keep_checkpoints_without_metrics)


def _steps(steps: Any) -> Policy:
    if not isinstance(steps, list | tuple):
        raise PolicyError(f"steps must be a list of step numbers, not {steps!r}")
    return KeepSteps(frozenset(_int("step", s) for s in steps))


def _any(policies: Any) -> Policy:
    if not isinstance(policies, list | tuple) or not all(isinstance(p, Policy) for p in policies):
        raise PolicyError("KeepAny takes a list of policies: KeepAny([KeepLatest(3), ...])")
    return KeepAny(tuple(policies))


_CONSTRUCTORS: dict[str, tuple[Callable[..., Policy], tuple[str, ...]]] = {
    "KeepLatest": (_latest, ("n",)),
    "LatestN": (_latest, ("n",)),
    "KeepEverySteps": (_every_steps, ("k",)),
    "EveryNSteps": (_every_steps, ("interval_steps", "exact_interval")),
    "KeepEverySeconds": (_every_seconds, ("s",)),
    "EveryNSeconds": (_every_seconds, ("interval_secs",)),
    "KeepMilestones": (KeepMilestones, ()),
    "Milestones": (KeepMilestones, ()),
    "KeepBest": (_best, ("metric", "n", "mode", "keep_without_metric")),
    "BestN": (_orbax_best, ("metric", "n", "reverse", "keep_checkpoints_without_metrics")),
    "KeepSteps": (_steps, ("steps",)),
    "CustomSteps": (_steps, ("steps",)),
    "KeepAll": (KeepAll, ()),
    "KeepAny": (_any, ("policies",)),
    "AnyPreservationPolicy": (_any, ("policies",)),
}


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float | str | bool):
        return node.value
    if isinstance(node, ast.Constant) and node.value is None:
        return None
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and isinstance(node.operand.value, int | float)
    ):
        return -node.operand.value
    if isinstance(node, ast.List | ast.Tuple):
        return [_eval(e) for e in node.elts]
    if isinstance(node, ast.Name) and node.id in _CONSTRUCTORS:
        return _call(node.id, [], {})
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id not in _CONSTRUCTORS:
            raise PolicyError(f"unknown policy {node.func.id!r}; known: {', '.join(_CONSTRUCTORS)}")
        kwargs = {k.arg: _eval(k.value) for k in node.keywords if k.arg is not None}
        return _call(node.func.id, [_eval(a) for a in node.args], kwargs)
    raise PolicyError(f"unexpected {ast.unparse(node)!r}; write policies such as KeepLatest(3)")


def _call(name: str, args: list[Any], kwargs: dict[str, Any]) -> Policy:
    fn, params = _CONSTRUCTORS[name]
    if len(args) > len(params):
        raise PolicyError(f"{name} takes at most {len(params)} arguments ({', '.join(params)})")
    unknown = set(kwargs) - set(params)
    if unknown:
        raise PolicyError(f"{name} has no argument {sorted(unknown)[0]!r}; it takes {params}")
    # The config's argument names (Orbax's, for the aliases) map by position
    # onto the constructor's own.
    own = list(inspect.signature(fn).parameters)
    try:
        return fn(*args, **{own[params.index(k)]: v for k, v in kwargs.items()})
    except TypeError:
        raise PolicyError(f"{name} needs the arguments ({', '.join(params)})") from None


def parse_policy(text: str) -> Policy:
    """Parse a retention expression; a top-level list means :class:`KeepAny`."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise PolicyError(
            f"cannot parse {text!r}; write e.g. KeepAny([KeepLatest(3), KeepEverySteps(10)])"
        ) from None
    value = _eval(tree.body)
    if isinstance(value, list):
        value = _any(value)
    if not isinstance(value, Policy):
        raise PolicyError(f"{text!r} is not a policy; write e.g. KeepLatest(3)")
    return value
