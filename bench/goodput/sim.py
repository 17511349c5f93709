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

A save of a :class:`Levelled` policy (DLRover's memory snapshots) that is not
durable never reaches the drain: only a trainer failure can restore it. With
``serial``, a save first waits for the previous one to commit (Orbax's and DCP's
``save()`` while an async save is in flight). Each save's costs are its arm's
measured at the pace nearest the time since the previous save, and a life's first
saves' their own (``Costs.for_save``). A policy with an
``upload_interval_seconds`` (the upload pace its commits ask of the daemon) has
the drain start uploads no closer together than that.

Steps between two saves are skipped in O(1) (cumulative step times) where the
policy provably cannot save in them; tests/test_goodput_sim.py checks that the
skip changes nothing. The costs and failure traces come from sim_inputs.py (a
costs JSON file per arm: costs-default.json holds placeholders until measured on
the real stack); bench/goodput/sim_run.py runs the cells, the peers and the
oracle.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
from sim_inputs import COSTS_DEFAULT, Costs, Dist, Failure, NodeRecord, cost_arms, failure_trace
from sim_inputs import Record as _Record

from ckptd.client.goodput import Goodput
from ckptd.client.policies import FixedInterval, SaveContext, SavePolicy

_FEED = 66
"""Steps fed to ``Goodput`` after a skip: its base-step window (64) is then filled
with real steps only, as if no step had been skipped."""


@runtime_checkable
class Levelled(Protocol):
    """A policy with two save levels: ``durable(step)`` says whether the save it
    asked for at ``step`` also goes to durable storage (survives a node loss).
    Saves of a policy without it all go to the drain (ckptd: LOCAL, then the
    bucket), or, for a peer that writes to remote storage directly, are durable
    once committed (its ``to_durable`` equal to its ``to_local``)."""

    def durable(self, step: int) -> bool:
        """True if the save at ``step`` goes to durable storage too."""
        ...


@dataclass(frozen=True)
class FlashCheckpoint(SavePolicy):
    """DLRover's flash checkpoint: a snapshot to the node's shared memory every
    ``memory_steps`` steps (it survives a trainer failure, not a node loss), and
    every ``durable_steps`` steps (a multiple of it) the snapshot persisted to
    storage too: its ``save_memory_interval`` / ``save_storage_interval``."""

    durable_steps: int
    memory_steps: int = 1

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.memory_steps == 0

    def durable(self, step: int) -> bool:
        """Every ``durable_steps``-th step's snapshot is persisted."""
        return step % self.durable_steps == 0


@dataclass
class _Save:
    step: int
    work: float
    started: float
    local_at: float
    upload: float
    drained: bool = True
    """Goes to durable storage (False: a memory snapshot, lost with the node)."""
    durable_at: float | None = None
    """None: not uploaded (yet, superseded by a newer save, or never: not drained)."""
    drain_before: tuple[float, float, float, _Save | None, float | None] = (
        0.0,
        -math.inf,
        0.0,
        None,
        None,
    )
    """The drain's free time, newest upload start, pace, waiting save and its DURABLE
    time before this save was queued (a save lost before LOCAL never reaches the
    drain: undone)."""
    gate: tuple[float, float] = (0.0, -math.inf)
    """The drain's free time and newest upload start its upload waited on (restored
    when a newer save takes its place before it starts)."""


class _Drain:
    """The daemon's drain: one upload at a time, newest first (a save still waiting
    when a newer one is LOCAL is never uploaded), and each upload started at least
    ``pace`` seconds after the previous one (lifecycle/pace.py: the job's newest
    commit sets it; 0, the default, uploads as soon as the drain is free)."""

    def __init__(self) -> None:
        self.free = 0.0  # the time the drain is next free
        self.started = -math.inf  # the time the newest upload started
        self.pace = 0.0
        self.waiting: _Save | None = None  # a save whose upload has not started

    def queue(self, new: _Save, pace: float = 0.0) -> None:
        """``new`` joins the drain once LOCAL: sets its ``durable_at``."""
        w = self.waiting
        was = w.durable_at if w is not None else None
        new.drain_before = (self.free, self.started, self.pace, w, was)
        if not new.drained:
            return
        self.pace = pace
        if w is not None and w.durable_at is not None and w.durable_at - w.upload > new.local_at:
            # not started when the newer one is LOCAL: the newer one goes instead
            (self.free, self.started), w.durable_at = w.gate, None
        new.gate = (self.free, self.started)
        start = max(new.local_at, self.free, self.started + self.pace)
        new.durable_at = start + new.upload
        self.waiting = new if start > new.local_at else None
        self.free, self.started = new.durable_at, start

    def undo(self, save: _Save) -> None:
        """``save`` was lost before LOCAL: it never reached the drain."""
        self.free, self.started, self.pace, self.waiting, was = save.drain_before
        if self.waiting is not None:
            self.waiting.durable_at = was

    def node_lost(self, at: float) -> None:
        """The node (and the drain's queue and paces with it) is gone at ``at``."""
        self.free, self.started, self.pace, self.waiting = at, -math.inf, 0.0, None


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

    def uploaded(self) -> bool:
        return self.mine is not None and self.mine.durable_at is not None


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
        and policy.node_mtbf_estimate_seconds is None
    ):
        return -int(min(save.started + policy.interval_seconds - now, 1e12))
    return 0


def _survivors(
    saves: list[_Save], drain: _Drain, failed_at: float, lost_at: float, node: bool
) -> tuple[list[_Save], _Save | None]:
    """After a failure at ``failed_at`` (the node lost at ``lost_at`` if ``node``):
    the saves still worth keeping (from the newest durable one on) and the newest
    save that survived, the one the next life restores."""
    if saves and saves[-1].local_at > failed_at:  # lost before LOCAL: never queued
        drain.undo(saves[-1])
    keep = [s for s in saves if s.local_at <= failed_at]
    if node:
        keep = [s for s in keep if s.durable_at is not None and s.durable_at <= lost_at]
        drain.node_lost(lost_at)
    newest = keep[-1] if keep else None
    durable = [s for s in keep if s.durable_at is not None and s.durable_at <= lost_at]
    return (keep[keep.index(durable[-1]) :] if durable else keep), newest


def simulate(
    make_policy: Callable[[], SavePolicy],
    costs: Costs,
    failures: list[Failure],
    horizon: float,
    seed: int,
    skip: bool = True,
    serial: bool = False,
    fleet: tuple[float, int] = (0.0, 0),
    start: Dist | None = None,
    node_fleet: tuple[float, int] | None = None,
) -> dict[str, float]:
    """One arm over one trace: goodput, overhead and counts. ``make_policy`` builds
    the policy of each life (a new ``Client`` per restart); ``serial``: a save
    first waits for the previous one to be committed (to_local), as Orbax's and
    DCP's ``save()`` do while an async save is in flight.

    ``overhead`` is the fraction of the trainer's running time (wall time less the
    restarts) spent blocked in saves and in the slowdown that follows them: the
    step-time cost of the arm's saves at the interval it chose. ``fleet``: the
    node's record of its earlier jobs (active seconds, restarts), ``Goodput()``'s
    prior until a node loss replaces the node. ``start``: the first process's start
    to its first step (None: at once; a real run of a minute pays for it).
    ``node_fleet``: the bucket's record of node names (node-seconds, replacements)
    besides this node's own, which a node loss does not take (it counts one
    replacement more); None: no such record."""
    rng = random.Random(seed * 7919 + 1)
    steps = _Steps(costs.step, seed, max(int(horizon / max(costs.step.mean, 1e-3)) + 1000, 1000))
    t, i, step, work = (start.draw(rng) if start else 0.0), 0, 0, 0.0
    saves: list[_Save] = []  # this and earlier lives', newest last, pruned
    drain = _Drain()
    bucket = NodeRecord(*node_fleet) if node_fleet is not None else None
    record = _Record(0.0, fleet, bucket)
    fails = iter(failures)
    nxt = next(fails, None)
    n_saves = n_fail = skipped = 0
    lost = overhead = down = 0.0
    while t < horizon:
        policy, mine, settled, in_life = make_policy(), None, 0, 0
        levelled = isinstance(policy, Levelled)
        slow: list[list[float]] = []  # [steps left, seconds per step] of open slowdowns

        view = _View()
        failed_at = None
        while t < horizon:
            fail_t = nxt.at if nxt is not None else math.inf
            if skip and not slow:
                q = _quiet_steps(policy, step, t, mine, settled)
                if q < 0:
                    q = steps.skippable(i, min(-q, fail_t - t, horizon - t), _FEED)
                elif q > 0:
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
            overhead += d - base
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
                view.uploaded,
            )
            if not policy.should_save(ctx):
                continue
            if serial and mine is not None and mine.local_at > t:
                wait = mine.local_at - t  # save() waits out the previous save's commit
                if t + wait > fail_t:
                    failed_at = fail_t
                    break
                t, overhead = t + wait, overhead + wait
            n_saves += 1
            in_life += 1
            paced = costs.for_save(in_life, t - mine.started if mine is not None else None)
            blocking = paced.save_blocking.draw(rng)
            local = max(paced.to_local.draw(rng), blocking)
            upload = max(paced.to_durable.draw(rng) - local, 0.0)
            if costs.to_durable == costs.to_local:  # the arm's one commit, to remote storage
                upload = 0.0
            drained = policy.durable(step) if levelled else True  # type: ignore[attr-defined]
            new = _Save(step, work, t, t + local, upload, drained)
            # a policy that paces the uploads (Goodput's two levels) says so on its save
            drain.queue(new, float(getattr(policy, "upload_interval_seconds", 0.0) or 0.0))
            saves.append(new)
            view.mine = mine = new
            settled = 0
            effective = paced.save_effective.draw(rng)
            if effective > 0:
                spread = max(paced.effective_spread_steps, 1)
                slow.append([spread, effective / spread])
            if t + blocking > fail_t:
                overhead += fail_t - t
                failed_at = fail_t
                break
            t += blocking
            overhead += blocking
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
        down += t - failed_at
        saves, newest = _survivors(saves, drain, failed_at, lost_at, node)
        lost += work - (newest.work if newest else 0.0)
        step, work = (newest.step, newest.work) if newest else (0, 0.0)
        if node:  # the new node's daemon starts the record again, with no other job's
            record = _Record(t, node=bucket)  # the bucket's record of the name survives
            if bucket is not None:
                bucket.replacements += 1
        if newest is not None:
            record.restarted(t)  # the new process restored the job's steps
    return {
        "goodput": work / t if t > 0 else 0.0,
        "overhead": overhead / (t - down) if t > down else 0.0,
        "saves": n_saves,
        "failures": n_fail,
        "lost_seconds": lost,
        "wall_seconds": t,
        "skipped_steps": skipped,
    }


__all__ = [
    "COSTS_DEFAULT",
    "Costs",
    "Dist",
    "Failure",
    "FlashCheckpoint",
    "Levelled",
    "cost_arms",
    "failure_trace",
    "simulate",
]
