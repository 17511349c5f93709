"""Goodput under failures, simulated: the real save policies on a simulated clock.

A trainer loop is simulated step by step: each step takes its own time (a
lognormal around the base step), and after each one the policy's own
``should_save`` decides with a :class:`SaveContext` whose ``now`` is the
simulated clock, ``previous_reached`` the simulated save's LOCAL/DURABLE times
and ``history`` the simulated daemon's record of the job. A save blocks the
trainer, slows the following steps by its effective cost, reaches LOCAL after
``to_local`` and DURABLE after one upload (the drain uploads one save at a time,
newest first: a save still waiting when a newer one is LOCAL is never uploaded).

A failure trace (exponential, or Weibull with shape < 1 for bursts) kills the
trainer at given wall times: a trainer failure restores the newest LOCAL save,
a node loss the newest DURABLE one, and the node's daemon record with it. Each
restart builds a new policy, as a new ``Client`` does; the daemon's record
(first seen, restarts) survives a trainer failure, so ``Goodput()`` learns the
MTBF from it as it does on the real stack.

    goodput = useful training seconds (the surviving steps' undisturbed time) / wall

Steps between two saves are skipped in O(1) (cumulative step times) where the
policy provably cannot save in them; tests/test_goodput_sim.py checks that the
skip changes nothing. The costs come from a JSON file (costs-default.json:
placeholders until measured on the real stack); bench/goodput/sim_run.py runs
the cells and the oracle.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ckptd.client.goodput import Goodput
from ckptd.client.policies import FailureHistory, FixedInterval, SaveContext, SavePolicy

COSTS_DEFAULT = Path(__file__).with_name("costs-default.json")
_FEED = 66
"""Steps fed to ``Goodput`` after a skip: its base-step window (64) is then filled
with real steps only, as if no step had been skipped."""


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
        if isinstance(spec, int | float):
            return cls(float(spec))
        if "samples" in spec:
            return cls(samples=tuple(float(x) for x in spec["samples"]))
        return cls(float(spec["median"]), float(spec.get("sigma", 0.0)))

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


@dataclass(frozen=True)
class Costs:
    """What the trainer and the stack cost: the fields of costs-default.json."""

    step: Dist
    save_blocking: Dist
    save_effective: Dist
    to_local: Dist
    to_durable: Dist
    restart: Dist
    node_restart: Dist
    effective_spread_steps: int = 1

    @classmethod
    def load(cls, path: Path = COSTS_DEFAULT) -> Costs:
        """Read a costs JSON file (keys other than the fields, e.g. "note", ignored)."""
        doc = json.loads(Path(path).read_text())
        names = ("step", "save_blocking", "save_effective", "to_local", "to_durable")
        dists = {k: Dist.of(doc[k]) for k in (*names, "restart", "node_restart")}
        return cls(**dists, effective_spread_steps=int(doc.get("effective_spread_steps", 1)))

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


@dataclass
class _Save:
    step: int
    work: float
    started: float
    local_at: float
    upload: float
    durable_at: float | None = None
    """None: not uploaded (yet, or superseded by a newer save)."""
    drain_before: tuple[float, _Save | None, float | None] = (0.0, None, None)
    """The drain's free time, waiting save and its DURABLE time before this save was
    queued (a save lost before LOCAL never reaches the drain: undone)."""


class _View:
    """What this life's client knows of its previous save, as ``previous_reached``."""

    def __init__(self) -> None:
        self.mine: _Save | None = None
        self.now = 0.0

    def reached(self, stage: str) -> bool:
        s = self.mine
        if s is None:
            return True
        if stage == "local":
            return self.now >= s.local_at
        # a superseded save has ended for good: reached, as the client answers
        return s.durable_at is None or self.now >= s.durable_at


class _Record:
    """The simulated daemon's record of the job (daemon/api/history.py)."""

    def __init__(self, first_seen: float) -> None:
        self.first_seen, self.restarts, self.now = first_seen, 0, first_seen

    def history(self) -> FailureHistory:
        return FailureHistory(self.now - self.first_seen, self.restarts)


class _Steps:
    """The executed steps' undisturbed times, drawn in chunks, with their cumulative
    sums so that a run of steps is skipped in O(1) (the same draws in every arm)."""

    def __init__(self, step: Dist, seed: int, chunk: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._step, self._chunk = step, chunk
        self.times = np.empty(0)
        self.cum = np.zeros(1)
        self._grow()

    def _grow(self) -> None:
        if self._step.samples:
            new = self._rng.choice(np.array(self._step.samples), self._chunk)
        else:
            new = self._step.median * np.exp(self._rng.normal(0.0, self._step.sigma, self._chunk))
        self.times = np.concatenate([self.times, new])
        self.cum = np.concatenate([self.cum, self.cum[-1] + np.cumsum(new)])

    def at(self, i: int) -> float:
        """Step ``i``'s time (``i`` counts every executed step, re-executed ones too)."""
        while i >= len(self.times):
            self._grow()
        return float(self.times[i])

    def skippable(self, i: int, seconds: float, keep: int) -> int:
        """How many steps from ``i`` can run so that ``keep`` more still end within
        ``seconds`` of step ``i``'s start."""
        while self.cum[-1] - self.cum[i] < seconds + 1.0:
            if len(self.times) > i + 10 * self._chunk:
                break
            self._grow()
        j = int(np.searchsorted(self.cum, self.cum[i] + seconds, side="right")) - 1
        return max(j - i - keep, 0)


def _quiet_steps(
    policy: SavePolicy, step: int, now: float, save: _Save | None, settled: int
) -> int:
    """Steps after this one at which ``policy`` cannot save (an upper bound on none),
    or a negative number of seconds: no save before ``-result`` more seconds."""
    if isinstance(policy, FixedInterval):
        return policy.steps - step % policy.steps - 1
    # Goodput, once the save is in and measured: until the next, the interval only
    # grows (the cost window is fixed and the learned MTBF grows with the time seen).
    if (
        isinstance(policy, Goodput)
        and save is not None
        and settled >= 3
        and policy.save_cost_seconds is not None
        and policy.node_mtbf_seconds is None
    ):
        return -int(min(save.started + policy.interval_seconds - now, 1e12))
    return 0


def simulate(
    make_policy: Callable[[], SavePolicy],
    costs: Costs,
    failures: list[Failure],
    horizon: float,
    seed: int,
    skip: bool = True,
) -> dict[str, float]:
    """One arm over one trace: goodput and counts. ``make_policy`` builds the policy
    of each life (a new ``Client`` per restart)."""
    rng = random.Random(seed * 7919 + 1)
    steps = _Steps(costs.step, seed, max(int(horizon / max(costs.step.mean, 1e-3)) + 1000, 1000))
    spread = max(costs.effective_spread_steps, 1)
    t, i, step, work = 0.0, 0, 0, 0.0
    saves: list[_Save] = []  # this and earlier lives', newest last, pruned
    drain_free, waiting = 0.0, None  # the drain's next free time; a save it has not started
    record = _Record(0.0)
    fails = iter(failures)
    nxt = next(fails, None)
    n_saves = n_fail = skipped = 0
    lost = 0.0
    while t < horizon:
        policy, mine, settled = make_policy(), None, 0
        slow: list[list[float]] = []  # [steps left, seconds per step] of open slowdowns

        view = _View()
        failed_at = None
        while t < horizon:
            fail_t = nxt.at if nxt is not None else math.inf
            if skip and not slow:
                q = _quiet_steps(policy, step, t, mine, settled)
                if q < 0:
                    q = steps.skippable(i, min(-q, fail_t - t, horizon - t), _FEED)
                else:
                    q = min(q, steps.skippable(i, min(fail_t, horizon) - t, 1))
                if q > 0:
                    dt = float(steps.cum[i + q] - steps.cum[i])
                    t, work, i, step = t + dt, work + dt, i + q, step + q
                    skipped += q
            d = base = steps.at(i)
            if slow:
                d += sum(s[1] for s in slow)
                for s in slow:
                    s[0] -= 1
                slow = [s for s in slow if s[0] > 0]
            if t + d > fail_t:
                failed_at = fail_t
                break
            t, work, i, step = t + d, work + base, i + 1, step + 1
            view.now = record.now = t
            if mine is not None and t >= mine.local_at:
                settled += 1  # calls that saw the newest save in
            ctx = SaveContext(
                step,
                t,
                mine.step if mine else None,
                mine.started if mine else None,
                view.reached,
                record.history,
            )
            if not policy.should_save(ctx):
                continue
            n_saves += 1
            blocking = costs.save_blocking.draw(rng)
            local = max(costs.to_local.draw(rng), blocking)
            upload = max(costs.to_durable.draw(rng) - local, 0.0)
            new = _Save(step, work, t, t + local, upload)
            new.drain_before = (drain_free, waiting, waiting and waiting.durable_at)
            if waiting is not None and waiting.durable_at is not None:
                start = waiting.durable_at - waiting.upload
                if start > new.local_at:  # not started: the newer one goes instead
                    drain_free, waiting.durable_at = start, None
            new.durable_at = max(new.local_at, drain_free) + upload
            waiting = new if new.durable_at - upload > new.local_at else None
            drain_free = new.durable_at
            saves.append(new)
            view.mine = mine = new
            settled = 0
            effective = costs.save_effective.draw(rng)
            if effective > 0:
                slow.append([spread, effective / spread])
            if t + blocking > fail_t:
                failed_at = fail_t
                break
            t += blocking
        if failed_at is None:
            break
        # The failure: restore the newest save that survived it; restart, and restart
        # again if another failure hits the restart.
        n_fail += 1
        node, lost_at = nxt.node, failed_at  # type: ignore[union-attr]
        nxt = next(fails, None)
        t = failed_at + (costs.node_restart if node else costs.restart).draw(rng)
        while nxt is not None and nxt.at < t:  # another failure during the restart
            n_fail += 1
            if nxt.node and not node:
                node, lost_at = True, nxt.at
            t = nxt.at + (costs.node_restart if node else costs.restart).draw(rng)
            nxt = next(fails, None)
        if saves and saves[-1].local_at > failed_at:  # lost before LOCAL: never queued
            drain_free, waiting, was = saves[-1].drain_before
            if waiting is not None:
                waiting.durable_at = was
        keep = [s for s in saves if s.local_at <= failed_at]
        if node:
            keep = [s for s in keep if s.durable_at is not None and s.durable_at <= lost_at]
            drain_free, waiting = lost_at, None
        newest = keep[-1] if keep else None
        durable = [s for s in keep if s.durable_at is not None and s.durable_at <= lost_at]
        saves = keep[keep.index(durable[-1]) :] if durable else keep
        lost += work - (newest.work if newest else 0.0)
        step, work = (newest.step, newest.work) if newest else (0, 0.0)
        if node:  # the new node's daemon starts the record again
            record = _Record(t)
        if newest is not None:
            record.restarts += 1  # the new process restored the job's steps
    return {
        "goodput": work / t if t > 0 else 0.0,
        "saves": n_saves,
        "failures": n_fail,
        "lost_seconds": lost,
        "wall_seconds": t,
        "skipped_steps": skipped,
    }


__all__ = ["COSTS_DEFAULT", "Costs", "Dist", "Failure", "failure_trace", "simulate"]
