"""The simulator's inputs: cost distributions per arm (a costs JSON file) and
failure traces.

A costs file (bench/goodput/costs-default.json; measured files in the same
format) holds ``note`` (what was measured, how, where), ``trainer``
("gpu-like", "jax" or "placeholder"), ``command`` (what reproduces it), the
trainer's ``step`` (one step with no save in flight), top-level defaults, and
one section per arm under ``"arms"``: ``ckptd`` (``Client.save``), ``orbax``
(Orbax ``CheckpointManager`` async save), ``dcp`` (torch DCP ``async_save``),
``dlrover`` (a memory snapshot every step, disk every N); the last two are
optional. An arm's costs are its section laid over the top level; a file
without ``"arms"`` (the older, flat format) is the ``ckptd`` arm alone. The keys:

- ``save_blocking``: seconds ``save()`` blocks the trainer;
- ``save_effective``: extra seconds the following ``effective_spread_steps``
  steps (an int, default 1) take in total while the save commits;
- ``to_local``: save start to restorable after a trainer-only failure (ckptd:
  LOCAL; a peer writing to remote storage: its commit; DLRover: in memory);
- ``to_durable``: save start to restorable after a node loss, on an idle drain
  (ckptd: DURABLE in the bucket). Equal to ``to_local`` (the same value): one
  commit, to remote storage, durable as soon as committed;
- ``restart``: trainer failure to the start of the new process's first step
  (restore included; measured to that step's end less one undisturbed step, which
  the simulator runs itself); ``node_restart``: the same after a node loss, on a
  new node;
- ``first_saves`` (optional): a list of objects, the save costs of a life's
  first, second, ... save (laid over the section): a new process's first saves
  pay for warming up (first leases, fresh memory, a framework's first async
  save); the section's own save costs are those of the saves after them;
- ``interval_s`` (optional): the seconds between save starts the save costs were
  measured at. A save's cost depends on its pace (buffers and page cache still
  warm from the previous save, an async commit still running): a section with
  ``"pace_of": ARM`` holds ARM's save costs measured at another ``interval_s``
  (laid over ARM's section: e.g. no ``to_durable`` where saves came too close
  together for the drain ever to be idle), and the simulator draws each save's
  costs from ARM's pace nearest (in ratio) the time since the previous save.

Each cost is a number (constant), a lognormal ``{"median": s, "sigma": s}`` or
``{"samples": [s, ...]}`` (measured values, drawn uniformly).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckptd.client.policies import FailureHistory

COSTS_DEFAULT = Path(__file__).with_name("costs-default.json")
_DISTS = (
    "step",
    "save_blocking",
    "save_effective",
    "to_local",
    "to_durable",
    "restart",
    "node_restart",
)


@dataclass(frozen=True)
class Dist:
    """A cost distribution: lognormal (``median``, ``sigma``) or ``samples`` drawn
    uniformly."""

    median: float = 0.0
    sigma: float = 0.0
    samples: tuple[float, ...] = ()

    @classmethod
    def of(cls, spec: Any) -> Dist:
        """From a JSON value: a number, {"median", "sigma"} or {"samples": [...]}."""
        if isinstance(spec, int | float) and not isinstance(spec, bool):
            return cls(float(spec))
        if isinstance(spec, dict) and spec.get("samples"):
            return cls(samples=tuple(float(x) for x in spec["samples"]))
        if isinstance(spec, dict) and "median" in spec:
            return cls(float(spec["median"]), float(spec.get("sigma", 0.0)))
        raise ValueError(
            f"a cost must be a number, {{'median': s, 'sigma': s}} or "
            f"{{'samples': [s, ...]}}, not {spec!r}"
        )

    @property
    def mean(self) -> float:
        """The distribution's mean."""
        if self.samples:
            return sum(self.samples) / len(self.samples)
        return self.median * math.exp(self.sigma**2 / 2)

    def draw(self, rng: random.Random) -> float:
        """One value."""
        if self.samples:
            return rng.choice(self.samples)
        return self.median * math.exp(rng.gauss(0.0, self.sigma)) if self.sigma else self.median


def _arms(doc: dict[str, Any]) -> dict[str, Any]:
    """The file's arm sections; the flat (older) format is the ckptd arm alone."""
    arms = doc.get("arms")
    return {"ckptd": doc} if arms is None else dict(arms)


def cost_arms(path: Path = COSTS_DEFAULT) -> tuple[str, ...]:
    """The arms a costs file has costs for (``ckptd`` alone in the flat format)."""
    return tuple(_arms(_read(path)))


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"no costs file at {path}: pass --costs with an existing file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e}): fix it or pass another --costs") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a costs file is a JSON object (see costs-default.json)")
    return doc


def _laid_over(arms: dict[str, Any], name: str) -> dict[str, Any]:
    """Section ``name``; a ``pace_of`` section holds only what differs at its pace, so
    it is laid over its arm's section."""
    own = dict(arms[name])
    base = arms.get(own.get("pace_of"))
    return (dict(base) | own) if isinstance(base, dict) else own


@dataclass(frozen=True)
class Costs:
    """What the trainer and one arm's stack cost (one arm of a costs file)."""

    step: Dist
    save_blocking: Dist
    save_effective: Dist
    to_local: Dist
    to_durable: Dist
    restart: Dist
    node_restart: Dist
    effective_spread_steps: int = 1
    interval_s: float = 0.0
    """Seconds between save starts the save costs were measured at (0: unknown)."""
    paces: tuple[Costs, ...] = ()
    """The same arm's save costs measured at other paces (``pace_of`` sections)."""
    first_saves: tuple[Costs, ...] = ()
    """The save costs of a life's first saves, one each (``first_saves``)."""

    @classmethod
    def load(cls, path: Path = COSTS_DEFAULT, arm: str = "ckptd") -> Costs:
        """``arm``'s costs from a costs JSON file: its section under ``"arms"`` over
        the top-level keys (keys other than the fields, e.g. "note", ignored)."""
        doc = _read(path)
        arms = _arms(doc)
        if arm not in arms:
            raise ValueError(
                f"{path} has no costs for arm {arm!r} (it has: {', '.join(sorted(arms))}); "
                f'add an "arms": {{"{arm}": {{...}}}} section or leave the arm out'
            )
        paces = tuple(
            cls._section(path, doc, name, _laid_over(arms, name))
            for name, spec in arms.items()
            if name != arm and isinstance(spec, dict) and spec.get("pace_of") == arm
        )
        return replace(cls._section(path, doc, arm, _laid_over(arms, arm)), paces=paces)

    @classmethod
    def _section(cls, path: Path, doc: dict[str, Any], arm: str, section: Any) -> Costs:
        spec = {k: v for k, v in doc.items() if k != "arms"} | dict(section)
        missing = [k for k in _DISTS if k not in spec]
        if missing:
            raise ValueError(
                f"{path}, arm {arm!r}: no {', '.join(missing)} (see costs-default.json)"
            )
        try:
            dists = {k: Dist.of(spec[k]) for k in _DISTS}
        except ValueError as e:
            raise ValueError(f"{path}, arm {arm!r}: {e}") from None
        firsts = spec.get("first_saves") or []
        if not isinstance(firsts, list) or not all(isinstance(f, dict) for f in firsts):
            raise ValueError(f"{path}, arm {arm!r}: first_saves must be a list of objects")
        plain = {k: v for k, v in spec.items() if k != "first_saves"}
        return cls(
            **dists,
            effective_spread_steps=int(spec.get("effective_spread_steps", 1)),
            interval_s=float(spec.get("interval_s", 0.0)),
            first_saves=tuple(cls._section(path, doc, arm, plain | f) for f in firsts),
        )

    def for_save(self, index: int, gap: float | None) -> Costs:
        """The costs of a life's ``index``-th save (from 1), ``gap`` seconds after the
        previous one started (None: the first): its pace's (:meth:`at`), and of
        those its own if it is one of the life's first saves."""
        paced = self.at(gap)
        return paced.first_saves[index - 1] if index <= len(paced.first_saves) else paced

    def at(self, gap: float | None) -> Costs:
        """The save costs measured at the pace nearest (in ratio) ``gap``, the seconds
        since the previous save started (None, a life's first save: the sparsest)."""
        every = [c for c in (self, *self.paces) if c.interval_s > 0]
        if not self.paces or len(every) < len(self.paces) + 1:
            return self
        if gap is None or gap <= 0:
            return max(every, key=lambda c: c.interval_s)
        return min(every, key=lambda c: abs(math.log(gap / c.interval_s)))

    @property
    def save_cost(self) -> float:
        """Mean trainer seconds per save (blocking + effective)."""
        return self.save_blocking.mean + self.save_effective.mean


@dataclass(frozen=True)
class Failure:
    """A failure at wall time ``at``: a node loss if ``node``, else a trainer failure."""

    at: float
    node: bool = False


def failure_trace(
    mtbf: float, horizon: float, seed: int, shape: float = 1.0, node_fraction: float = 0.0
) -> list[Failure]:
    """Failures over ``horizon`` seconds, gaps Weibull(``shape``) with mean ``mtbf``
    (shape 1: exponential; < 1: bursty), each a node loss with ``node_fraction``."""
    rng = random.Random(seed)
    scale = mtbf / math.gamma(1.0 + 1.0 / shape)
    out, t = [], 0.0
    while True:
        t += rng.weibullvariate(scale, shape)
        if t >= horizon:
            return out
        out.append(Failure(t, rng.random() < node_fraction))


def phased_trace(
    phases: list[tuple[float, float]], seed: int, shape: float = 1.0, node_fraction: float = 0.0
) -> list[Failure]:
    """Failures whose rate changes: ``(mtbf, seconds)`` phases one after another (a
    bad rack for a day, a quiet week), each :func:`failure_trace` of its own MTBF."""
    out: list[Failure] = []
    start = 0.0
    for n, (mtbf, seconds) in enumerate(phases):
        trace = failure_trace(mtbf, seconds, seed * 1009 + n, shape, node_fraction)
        out += [Failure(start + f.at, f.node) for f in trace]
        start += seconds
    return out


def mean_mtbf(phases: list[tuple[float, float]]) -> float:
    """The MTBF over all the phases (their time over their expected failures)."""
    return sum(s for _, s in phases) / sum(s / m for m, s in phases)


def kill_times(mtbf: float, seconds: float, seed: int) -> list[float]:
    """The real harness's failure times in [0, seconds) (bench/goodput/run.py): a
    Poisson process of rate 1/mtbf, numpy's exponential draws from ``seed``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    times, t = [], 0.0
    while True:
        t += float(rng.exponential(mtbf))
        if t >= seconds:
            return times
        times.append(t)


@dataclass
class NodeRecord:
    """The simulated bucket's record of node names (daemon/remote/node_fleet.py):
    the other names' node-seconds and replacements; this node's own name adds its
    time since the simulation's start. It outlives a node loss."""

    seconds: float = 0.0
    replacements: int = 0


class Record:
    """The simulated daemon's record of the job (daemon/api/history.py), and the
    bucket's of the node names (None: no bucket record)."""

    def __init__(
        self, first_seen: float, fleet: tuple[float, int] = (0.0, 0), node: NodeRecord | None = None
    ) -> None:
        self.first_seen, self.restarts, self.now = first_seen, 0, first_seen
        self.times: list[float] = []
        self.fleet = fleet
        """The node's record of its other jobs: (active seconds, restarts)."""
        self.node = node

    def restarted(self, at: float) -> None:
        self.restarts += 1
        self.times = [*self.times[-31:], at]

    def history(self) -> FailureHistory:
        ages = tuple(self.now - t for t in reversed(self.times))
        node = self.node
        return FailureHistory(
            self.now - self.first_seen,
            self.restarts,
            ages,
            *self.fleet,
            node.seconds + self.now if node is not None else 0.0,
            node.replacements if node is not None else 0,
        )


__all__ = [
    "COSTS_DEFAULT",
    "Costs",
    "Dist",
    "Failure",
    "NodeRecord",
    "Record",
    "cost_arms",
    "failure_trace",
    "kill_times",
    "mean_mtbf",
    "phased_trace",
]
