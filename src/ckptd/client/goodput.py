"""``Goodput()``: the save interval that maximises expected goodput, from the trainer's
own measurements.

The model (Young 1974 / Daly 2006, with the costs measured rather than guessed).
A save every ``tau`` seconds costs the trainer ``C`` seconds of progress (its
*effective* cost: the time ``save()`` blocks plus how much slower the steps run
while the daemon commits it, both measured here); a failure, at rate ``lambda``,
loses the work since the newest copy that survived it: on average ``tau / 2``
plus ``L``, the time a save takes to reach the tier the failure leaves (LOCAL for
a trainer crash, DURABLE for a lost node). The expected goodput is then

    G(tau) = (1 - C / tau) * (1 - lambda_t * (tau / 2 + L_local)
                                 - lambda_n * (tau / 2 + L_durable))

and setting dG/dtau = 0 gives

    tau* = sqrt(2 * C * A / (lambda_t + lambda_n)),
    A    = 1 - lambda_t * L_local - lambda_n * L_durable

(``A`` is the fraction of time not lost to commit latency; ``tau*`` reduces to
Young's ``sqrt(2 C M)`` when the latencies are small). The restart cost does not
move ``tau*``: it is paid per failure whatever the interval.

Two levels (``node_mtbf_seconds`` given, ``stage="local"``), after the multi-level
checkpointing literature (SCR; Di et al.): a save every ``tau`` seconds goes to
the local tier, and every ``k``-th one on to the bucket, where an upload costs
the trainer ``C_D`` (the extra step time from LOCAL to DURABLE: the drain's CPU
and network) and a node loss loses the work since the newest upload. Per cycle
of ``k`` saves the overhead is ``(C + C_D / k) / tau + (lambda_t + k lambda_n) tau / 2``,
least at

    k*   = sqrt(C_D lambda_t / (C lambda_n))    (the better whole number beside it)
    tau* = sqrt(2 (C + C_D / k) A / (lambda_t + k lambda_n))

so free uploads (``C_D`` 0) go with every save (``k`` 1, ``tau*`` as above) and
dear ones under rare node losses with every ``k``-th. The policy asks the
daemon's drain for that pace (``upload_interval_seconds = k tau``, sent with
each commit; daemon/lifecycle/pace.py); the saves the pace skips end
SUPERSEDED.

Measured online, re-estimated as conditions change:

- the base step time: the lower quartile of the last 64 steps with no save in
  flight (the steps just after a save still carry its tail, and a busy host only
  ever adds time: the low quartile is the step undisturbed); at least 2 such steps
  are timed between saves, so the base follows the host even when ``tau*`` is
  shorter than a step (without them a base measured high, e.g. on a slow warm-up,
  made every save look free, ``tau*`` 0, and no step quiet to correct it);
- ``C``: for each of the last 8 saves, the sum over the steps from the one that
  called ``save()`` until the save reached ``stage`` of (step time - base);
  ``C`` is their median, so a one-off stall does not swing the interval;
- ``L``: the median time from a save's start to it reaching LOCAL (and, with
  ``node_mtbf_seconds``, DURABLE: of the saves actually uploaded);
- ``C_D`` (two levels): the median over the last 8 uploads of the extra step time
  from the save's LOCAL to its DURABLE.

The failure rates: ``mtbf_seconds`` is the mean time between failures that
restart the trainer (job-wide: with N nodes failing independently, the node
MTBF divided by N). Left at None it is learned (:func:`learned_mtbf`) from the
daemon's record of the job (daemon/api/history.py, kept across daemon restarts):
``n`` restarts in ``T`` seconds of the job's active time, and a prior ``M0``:
``prior_mtbf_seconds`` if given, else the node's record of every other job
(their active time over their restarts + 1). The estimate is

    M = (T + M0) / (n + 1)

the prior weighing as one failure interval: a young job on a node that has seen
few failures saves at about ``tau*(M0)``, not at every step; with no prior at all
(``M0`` = 0) it is ``T / (n + 1)``, short while little has been seen (it saves
often) and growing as failure-free time accumulates. It never exceeds what was
observed plus the prior, so it errs towards saving too often. When the rate
changes, the newest restarts overrule it: the newest 8 restarts within
``M / 2.5`` of each other on average (a bad rack: about 1% likely at the old
rate) give ``M = age of the 8th newest / 8``; no restart for ``4 M`` (a quiet
week: 2% likely) gives ``M = age of the newest / 2``.

``node_mtbf_seconds`` counts the failures that also lose the node's disk
(restored from the bucket; set it with ``stage="durable"`` so each save is
measured until it is in the bucket). Left at None it is learned
(:func:`learned_node_mtbf`) from the bucket's record of node names, which
outlives a lost node as the daemon's record does not: each name's claim keeps
how long it has been claimed and how often a new disk replaced its node
(daemon/remote/claim.py), and the daemon sums this node's and a sample of the
fleet's (daemon/remote/node_fleet.py): ``r`` replacements in ``S`` node-seconds
give a node MTBF of ``S / (r + 1)`` per node (the unseen next loss weighing as one
interval, as above: it errs towards saving often), divided by the ``N`` nodes the
job spans (``Client``'s ``world_size`` over its ``node_ranks``). With no bucket
(``S`` 0) there is no node level. A node MTBF, configured or learned, brings the
two levels with ``stage="local"``. ``mtbf_seconds=math.inf`` counts node losses
only.

Until one save has been measured the policy saves as soon as the previous save
is in (``Continuous()``), then widens the interval to ``tau*``.

``Goodput()`` is the client's default policy (``Client(job)``). It times the
trainer's steps by the calls to ``should_save``, so the loop must call it once
per step (as the README's loops do); a loop that wants every possible save
(a stress test, a benchmark of the save path) asks for ``Continuous()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .policies import FailureHistory, SaveContext, SavePolicy
from .window import Window

_BASE_WINDOW = 64
_COST_WINDOW = 8
_MIN_QUIET = 2
"""Steps timed with no save in flight between two saves (the base step time's feed)."""
_RECENT = 8
"""Restarts in the window that may overrule the long-run estimate (a rate change)."""
_FASTER = 2.5
"""How much shorter the window's MTBF must be to overrule (P ~ 1% at a steady rate)."""
_QUIETER = 4.0
"""How many MTBFs without a restart overrule the estimate (P = e^-4 at a steady rate)."""
_MOST_SECONDS = 2.0**45
"""Most seconds of a daemon's record taken as told (a million years: 512 jobs' or a
fleet sample's lives summed stay far below it)."""
_MOST_COUNT = 2**32
"""Most restarts or replacements of a daemon's record taken as told."""


def bounded(seen: FailureHistory) -> FailureHistory:
    """``seen`` with every value no honest daemon sends read as not known: a time
    that is not finite, negative or past :data:`_MOST_SECONDS` as 0, a count below 0
    as 0 and above :data:`_MOST_COUNT` as that, a restart age that is no age left
    out. Each errs towards saving more often, never less: a daemon's record is
    passed on from its bucket, where anyone who may write can write anything."""

    def secs(value: float) -> float:
        return float(value) if 0 <= value <= _MOST_SECONDS else 0.0  # NaN fails both

    def count(value: int) -> int:
        return min(max(int(value), 0), _MOST_COUNT)

    return FailureHistory(
        secs(seen.observed_seconds),
        count(seen.restarts),
        tuple(float(a) for a in seen.restart_ages if 0 <= a <= _MOST_SECONDS),
        secs(seen.fleet_observed_seconds),
        count(seen.fleet_restarts),
        secs(seen.node_observed_seconds),
        count(seen.node_replacements),
        max(count(seen.job_nodes), 1),
    )


def learned_mtbf(seen: FailureHistory, prior_mtbf: float | None = None) -> float:
    """The trainer MTBF learned from the daemon's record (see the module): the
    long-run estimate with its prior, unless the newest restarts say the rate
    changed. ``prior_mtbf`` None: the node's record of the other jobs, if any."""
    seen = bounded(seen)
    prior = prior_mtbf
    if prior is None and seen.fleet_observed_seconds > 0:
        prior = seen.fleet_observed_seconds / (seen.fleet_restarts + 1)
    mtbf = (max(seen.observed_seconds, 0.0) + (prior or 0.0)) / (seen.restarts + 1)
    ages = seen.restart_ages
    if len(ages) >= _RECENT and ages[_RECENT - 1] / _RECENT < mtbf / _FASTER:
        return ages[_RECENT - 1] / _RECENT
    if ages and ages[0] > _QUIETER * mtbf:
        return ages[0] / 2
    return max(mtbf, 1e-3)


def learned_node_mtbf(seen: FailureHistory) -> float | None:
    """The job's node MTBF learned from the bucket's record of node names (see the
    module): ``S / (r + 1)`` per node over the ``job_nodes`` the job spans; None
    with no record (no bucket)."""
    seen = bounded(seen)
    if seen.node_observed_seconds <= 0:
        return None
    per_node = seen.node_observed_seconds / (seen.node_replacements + 1)
    return max(per_node / max(seen.job_nodes, 1), 1e-3)


def optimal_interval(
    cost: float,
    mtbf: float | None,
    local_latency: float = 0.0,
    node_mtbf: float | None = None,
    durable_latency: float = 0.0,
) -> float:
    """``tau*`` of the module's model, in seconds (0 when a save costs nothing; inf
    when no failure is expected). ``mtbf``/``node_mtbf`` None or inf: not counted."""
    rate_t = 1.0 / mtbf if mtbf else 0.0
    rate_n = 1.0 / node_mtbf if node_mtbf else 0.0
    if rate_t + rate_n <= 0.0:
        return math.inf
    available = max(1.0 - rate_t * local_latency - rate_n * durable_latency, 0.05)
    return math.sqrt(2.0 * max(cost, 0.0) * available / (rate_t + rate_n))


def two_level_interval(
    cost: float,
    upload_cost: float,
    mtbf: float | None,
    node_mtbf: float,
    local_latency: float = 0.0,
    durable_latency: float = 0.0,
) -> tuple[float, int]:
    """``(tau, k)``: save locally every ``tau`` seconds and upload every ``k``-th save
    (see the module's two-level model); ``k`` 1 when uploads cost the trainer
    nothing, ``tau`` then :func:`optimal_interval`'s."""
    rate_t = 1.0 / mtbf if mtbf else 0.0
    rate_n = 1.0 / node_mtbf
    cost, upload_cost = max(cost, 0.0), max(upload_cost, 0.0)
    if cost <= 0.0 or upload_cost <= 0.0 or rate_t <= 0.0:
        k = 1
    else:  # g(k) = (C + C_D / k)(lambda_t + k lambda_n) is least at sqrt(C_D lambda_t / C lambda_n)
        best = math.sqrt(upload_cost * rate_t / (cost * rate_n))
        k = min(
            {max(math.floor(best), 1), max(math.ceil(best), 1)},
            key=lambda n: (cost + upload_cost / n) * (rate_t + n * rate_n),
        )
    available = max(1.0 - rate_t * local_latency - rate_n * durable_latency, 0.05)
    tau = math.sqrt(2.0 * (cost + upload_cost / k) * available / (rate_t + k * rate_n))
    return tau, k


def expected_goodput(
    interval: float,
    cost: float,
    mtbf: float,
    local_latency: float = 0.0,
    node_mtbf: float | None = None,
    durable_latency: float = 0.0,
) -> float:
    """``G(tau)`` of the module's model (clipped at 0)."""
    rate_n = 1.0 / node_mtbf if node_mtbf else 0.0
    lost = (interval / 2 + local_latency) / mtbf + rate_n * (interval / 2 + durable_latency)
    return max((1.0 - cost / interval) * (1.0 - lost), 0.0) if interval > 0 else 0.0


@dataclass
class Goodput(SavePolicy):
    """Save every ``tau*`` seconds (see the module's model), with ``C`` and ``L``
    measured from this trainer's own step times, once the previous save reached
    ``stage``. ``interval_seconds`` is the interval now in force (read it to log it).

    ``mtbf_seconds``: mean time between failures that restart the trainer (job-wide;
    None: learned from the daemon's record of this job's restarts; inf: not counted).
    ``node_mtbf_seconds``: those that lose the node too (None: learned from the
    bucket's record of replaced nodes; not counted without a bucket; inf: not counted).
    ``prior_mtbf_seconds``: the MTBF a job starts from while it has seen little
    (None: the node's record of other jobs); ignored with ``mtbf_seconds``.
    ``min_interval_seconds`` / ``max_interval_seconds`` clamp ``tau*``.
    ``warmup_steps``: steps timed before the first save (a base step time to measure
    the first save's cost against; the first steps' compilation is outvoted by the
    median).
    """

    mtbf_seconds: float | None = None
    node_mtbf_seconds: float | None = None
    stage: str = "local"
    prior_mtbf_seconds: float | None = None
    min_interval_seconds: float = 0.0
    max_interval_seconds: float | None = None
    warmup_steps: int = 3

    interval_seconds: float = field(default=0.0, init=False)
    mtbf_estimate_seconds: float | None = field(default=None, init=False)
    """The trainer MTBF in force: ``mtbf_seconds``, or the learned estimate."""
    node_mtbf_estimate_seconds: float | None = field(default=None, init=False)
    """The job's node MTBF in force: ``node_mtbf_seconds``, or the learned estimate
    (None: node losses not counted)."""
    _prev_now: float | None = field(default=None, init=False, repr=False)
    _first_now: float | None = field(default=None, init=False, repr=False)
    _steps: int = field(default=0, init=False, repr=False)
    _quiet: Window = field(default_factory=lambda: Window(_BASE_WINDOW, 0.25), init=False)
    _quiet_run: int = field(default=0, init=False, repr=False)
    """Quiet steps timed since the last save reached its stage."""
    _costs: Window = field(default_factory=lambda: Window(_COST_WINDOW), init=False)
    _to_local: Window = field(default_factory=lambda: Window(_COST_WINDOW), init=False)
    _to_durable: Window = field(default_factory=lambda: Window(_COST_WINDOW), init=False)
    _seen_save_at: float | None = field(default=None, init=False, repr=False)
    _extra: float | None = field(default=None, init=False, repr=False)
    """Extra seconds the open save has cost so far (None: no save being measured)."""
    _durable_open: bool = field(default=False, init=False, repr=False)
    _uploads: Window = field(default_factory=lambda: Window(_COST_WINDOW), init=False)
    _upload_extra: float | None = field(default=None, init=False, repr=False)
    """Extra seconds the open save's upload has cost so far (two levels only)."""
    upload_interval_seconds: float = field(default=0.0, init=False)
    """Seconds between the uploads the daemon's drain starts for this job (0: every
    save, as soon as it can): ``k * interval_seconds`` of the two-level model."""

    def __post_init__(self) -> None:
        if self.stage not in ("local", "durable"):
            raise ValueError(f"stage must be 'local' or 'durable', not {self.stage!r}")
        for name in ("mtbf_seconds", "node_mtbf_seconds", "prior_mtbf_seconds"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, not {value!r}")
        if self.mtbf_seconds == math.inf and self.node_mtbf_seconds in (None, math.inf):
            raise ValueError(
                "mtbf_seconds=inf with no finite node_mtbf_seconds counts no failures: give a "
                "node_mtbf_seconds, or leave mtbf_seconds None to learn it"
            )
        if self.min_interval_seconds < 0:
            raise ValueError("min_interval_seconds must be >= 0")
        if self.warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")

    # -- measurements -------------------------------------------------------------
    @property
    def base_step_seconds(self) -> float | None:
        """Lower-quartile step time with no save in flight (None before any)."""
        return self._quiet.stat()

    @property
    def save_cost_seconds(self) -> float | None:
        """Median effective cost of the recent saves (None before one is measured)."""
        return self._costs.stat()

    @property
    def upload_cost_seconds(self) -> float | None:
        """Median extra step time of the recent uploads, from LOCAL to DURABLE (two
        levels only; None before one is measured)."""
        return self._uploads.stat()

    def _observe(self, ctx: SaveContext) -> None:
        """Account the step that just ended (from the previous call to this one)."""
        dt = None if self._prev_now is None else ctx.now - self._prev_now
        if self._first_now is None:
            self._first_now = ctx.now
        self._prev_now = ctx.now
        self._steps += 1
        if ctx.last_save_at is not None and ctx.last_save_at != self._seen_save_at:
            # A save started in the step that just ended: it holds save()'s blocking
            # part. Measure from here until the save reaches the stage.
            if self._extra is not None:
                self._costs.append(self._extra)  # superseded before it was in
            self._seen_save_at = ctx.last_save_at
            self._extra = 0.0
            self._durable_open = self.node_mtbf_estimate_seconds is not None
        base = self.base_step_seconds
        if dt is None:
            return
        if self._extra is None:
            self._quiet.append(dt)
            self._quiet_run += 1
        elif base is not None:
            self._extra += max(dt - base, 0.0)
        if self._upload_extra is not None and base is not None:
            self._upload_extra += max(dt - base, 0.0)
        if self._extra is not None and ctx.previous_reached(self.stage):
            self._quiet_run = 0
            self._costs.append(self._extra)
            self._to_local.append(ctx.now - (self._seen_save_at or ctx.now))
            self._extra = None
            if self._durable_open and self.stage == "local":  # two levels (see the module)
                self._upload_extra = 0.0  # the upload's cost: from here to DURABLE
        if self._durable_open and ctx.previous_reached("durable"):
            if ctx.previous_uploaded():  # not a save the pace (or coalescing) skipped
                self._to_durable.append(ctx.now - (self._seen_save_at or ctx.now))
                if self._upload_extra is not None:
                    self._uploads.append(self._upload_extra)
            self._durable_open, self._upload_extra = False, None

    def _mtbf(self, ctx: SaveContext, seen: FailureHistory | None) -> float:
        """The trainer MTBF: configured, or learned (:func:`learned_mtbf`) from ``seen``
        (the daemon's record)."""
        if self.mtbf_seconds is not None:
            return self.mtbf_seconds
        if seen is None:  # a daemon without the record: this process's own life
            first = ctx.now if self._first_now is None else self._first_now
            seen = FailureHistory(ctx.now - first, 0)
        return learned_mtbf(seen, self.prior_mtbf_seconds)

    def _node_mtbf(self, seen: FailureHistory | None) -> float | None:
        """The job's node MTBF: configured, or learned (:func:`learned_node_mtbf`)."""
        if self.node_mtbf_seconds is not None:  # inf: node losses not counted
            return self.node_mtbf_seconds if self.node_mtbf_seconds < math.inf else None
        return learned_node_mtbf(seen) if seen is not None else None

    def _interval(self, ctx: SaveContext) -> float:
        cost = self.save_cost_seconds
        if cost is None:
            return self.min_interval_seconds
        learned = self.mtbf_seconds is None or self.node_mtbf_seconds is None
        seen = ctx.history() if learned else None  # asked once a step
        self.mtbf_estimate_seconds = self._mtbf(ctx, seen)
        node_mtbf = self.node_mtbf_estimate_seconds = self._node_mtbf(seen)
        to_local = self._to_local.stat() or 0.0
        to_durable = self._to_durable.stat() or 0.0
        if node_mtbf is not None and self.stage == "local":  # two levels (see the module)
            upload_cost = self.upload_cost_seconds or 0.0
            tau, k = two_level_interval(
                cost, upload_cost, self.mtbf_estimate_seconds, node_mtbf, to_local, to_durable
            )
            self.upload_interval_seconds = k * tau if k > 1 else 0.0
        else:
            tau = optimal_interval(
                cost, self.mtbf_estimate_seconds, to_local, node_mtbf, to_durable
            )
        tau = max(tau, self.min_interval_seconds)
        if self.max_interval_seconds is not None:
            tau = min(tau, self.max_interval_seconds)
        return tau

    # -- the decision -------------------------------------------------------------
    def should_save(self, ctx: SaveContext) -> bool:
        self._observe(ctx)
        self.interval_seconds = self._interval(ctx)
        if ctx.last_save_at is None:
            return self._steps > self.warmup_steps
        if self._extra is not None:
            return False  # the previous save is not in yet (and is being measured)
        if self._quiet_run < _MIN_QUIET:
            return False  # the base step time is fed between saves (see the module)
        return ctx.now - ctx.last_save_at >= self.interval_seconds


__all__ = [
    "Goodput",
    "bounded",
    "expected_goodput",
    "learned_mtbf",
    "learned_node_mtbf",
    "optimal_interval",
    "two_level_interval",
]
