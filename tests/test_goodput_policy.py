"""``Goodput()`` (issue 17) against a simulated trainer: it measures the base step
time and each save's effective cost from the step times it sees, and saves at the
interval its model says maximises goodput; its failure rate configured or learned
from the daemon's record of the job's restarts (a real daemon at the end)."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from ckptd.client import FailureHistory, Goodput
from ckptd.client.goodput import expected_goodput, optimal_interval
from ckptd.client.policies import SaveContext


class Trainer:
    """A loop whose steps take ``step`` seconds, a save adding ``block`` to the step
    that calls it and ``slow`` to each of the ``commit_steps`` steps after, until the
    save is LOCAL."""

    def __init__(
        self,
        step: float,
        block: float,
        slow: float,
        commit_steps: int,
        history: FailureHistory | None = None,
        warmup: tuple[float, ...] = (),
    ) -> None:
        self.step_s, self.block, self.slow, self.commit_steps = step, block, slow, commit_steps
        self.warmup = warmup  # extra seconds of the first steps
        self.history = history  # what the daemon has seen, at now = 0
        self.now = 0.0
        self.saves: list[tuple[int, float]] = []  # (step, time)
        self.local_at = 0  # the step at which the last save is LOCAL

    def run(self, policy: Goodput, steps: int) -> None:
        for step in range(steps):
            last = self.saves[-1] if self.saves else None
            ctx = SaveContext(
                step,
                self.now,
                last[0] if last else None,
                last[1] if last else None,
                lambda _stage, step=step, last=last: last is None or step >= self.local_at,
                self._history,
            )
            dt = self.step_s + (self.warmup[step] if step < len(self.warmup) else 0.0)
            if last is not None and last[0] < step < self.local_at:
                dt += self.slow
            if policy.should_save(ctx):
                self.saves.append((step, self.now))
                self.local_at = step + 1 + self.commit_steps
                dt += self.block
            self.now += dt

    def _history(self) -> FailureHistory | None:
        if self.history is None:
            return None
        return FailureHistory(self.history.observed_seconds + self.now, self.history.restarts)


def test_the_interval_is_youngs_from_the_measured_cost() -> None:
    # 1 s steps; a save blocks 0.2 s and slows the 3 steps after it by 0.1 s each:
    # C = 0.5 s. It is LOCAL 4 steps (4.5 s) after it started.
    trainer = Trainer(step=1.0, block=0.2, slow=0.1, commit_steps=3)
    policy = Goodput(mtbf_seconds=400.0)
    trainer.run(policy, 400)
    assert policy.base_step_seconds == pytest.approx(1.0)
    assert policy.save_cost_seconds == pytest.approx(0.5)
    want = math.sqrt(2 * 0.5 * (1 - 4.5 / 400) * 400)  # ~19.9 s
    assert policy.interval_seconds == pytest.approx(want, rel=1e-6)
    # The first save comes after the warm-up steps; then one every ceil(tau*) steps
    # or so (a step is 1 s, plus what the save costs).
    gaps = [b[1] - a[1] for a, b in zip(trainer.saves[1:], trainer.saves[2:], strict=False)]
    assert trainer.saves[0][0] == 3 and gaps
    assert all(want <= g <= want + 2.0 for g in gaps), gaps


def test_a_slow_warm_up_does_not_make_saves_look_free() -> None:
    # The first steps take 0.6 s instead of 0.45 (a restarted process faulting its
    # memory in); a save blocks 0.05 s and is LOCAL within its step. Measured against
    # the warm-up's base, every save looked free (cost 0, tau* 0): the policy saved at
    # every step, so no step was quiet and the base never came down. Quiet steps
    # between saves keep the base (and so the cost) right.
    # A young job's learned MTBF is its age, so tau* starts below a step.
    trainer = Trainer(step=0.45, block=0.05, slow=0.0, commit_steps=0, warmup=(0.15,) * 4)
    policy = Goodput()  # no daemon record here: learned from this process's own life
    trainer.run(policy, 400)
    assert policy.base_step_seconds == pytest.approx(0.45)
    assert policy.save_cost_seconds == pytest.approx(0.05)
    age = policy.mtbf_estimate_seconds
    assert age is not None and age > 150
    assert policy.interval_seconds == pytest.approx(math.sqrt(2 * 0.05 * age), rel=0.01)
    assert len(trainer.saves) < 400 / 3  # not one per step


def test_a_dearer_save_or_rarer_failures_widen_the_interval() -> None:
    intervals = {}
    for cost, mtbf in ((0.2, 100.0), (0.8, 100.0), (0.2, 1600.0)):
        trainer = Trainer(step=0.5, block=cost, slow=0.0, commit_steps=1)
        policy = Goodput(mtbf_seconds=mtbf)
        trainer.run(policy, 300)
        intervals[(cost, mtbf)] = policy.interval_seconds
    assert intervals[(0.8, 100.0)] == pytest.approx(2 * intervals[(0.2, 100.0)], rel=0.05)
    assert intervals[(0.2, 1600.0)] == pytest.approx(4 * intervals[(0.2, 100.0)], rel=0.05)


def test_re_estimated_when_saves_get_cheaper() -> None:
    trainer = Trainer(step=1.0, block=2.0, slow=0.0, commit_steps=1)
    policy = Goodput(mtbf_seconds=200.0)
    trainer.run(policy, 300)
    dear = policy.interval_seconds
    trainer.block = 0.125
    trainer.run(policy, 600)  # 8 saves later the median is the new cost
    assert policy.save_cost_seconds == pytest.approx(0.125)
    assert policy.interval_seconds == pytest.approx(dear / 4, rel=0.05)


def test_waits_for_the_previous_save_and_clamps() -> None:
    trainer = Trainer(step=1.0, block=0.0, slow=0.0, commit_steps=20)
    policy = Goodput(mtbf_seconds=1e9, max_interval_seconds=5.0)
    trainer.run(policy, 100)
    starts = [s for s, _ in trainer.saves]
    assert all(b - a >= 21 for a, b in itertools.pairwise(starts))  # never two at once
    free = Trainer(step=1.0, block=0.0, slow=0.0, commit_steps=0)
    floor = Goodput(mtbf_seconds=10.0, min_interval_seconds=7.0)
    free.run(floor, 50)
    assert floor.interval_seconds == 7.0  # a free save still waits the minimum


def test_the_model() -> None:
    tau = optimal_interval(cost=1.0, mtbf=3600.0)
    assert tau == pytest.approx(math.sqrt(2 * 3600.0))
    # tau* is the maximum of G: nearby intervals do worse.
    g = expected_goodput(tau, 1.0, 3600.0)
    assert g > expected_goodput(tau * 0.8, 1.0, 3600.0)
    assert g > expected_goodput(tau * 1.25, 1.0, 3600.0)
    both = optimal_interval(1.0, 3600.0, 2.0, node_mtbf=3600.0, durable_latency=30.0)
    assert both < tau  # node losses too: more failures, save more often
    assert optimal_interval(0.0, 10.0) == 0.0
    with pytest.raises(ValueError, match="mtbf_seconds must be > 0"):
        Goodput(mtbf_seconds=0)
    with pytest.raises(ValueError, match="stage must be"):
        Goodput(stage="bucket")


def test_the_failure_rate_is_learned_from_the_restarts() -> None:
    # The daemon saw the job 96 s ago and 3 restarts: T / (n + 1) = 24 s at first,
    # growing as the run goes on without a failure.
    trainer = Trainer(step=1.0, block=0.5, slow=0.0, commit_steps=1, history=FailureHistory(96, 3))
    policy = Goodput()
    trainer.run(policy, 40)
    assert policy.save_cost_seconds == pytest.approx(0.5)
    mtbf = (96 + trainer.now) / 4
    assert policy.mtbf_estimate_seconds == pytest.approx(mtbf, abs=1.0)
    assert policy.interval_seconds == pytest.approx(optimal_interval(0.5, mtbf, 2.0), abs=0.1)
    # The same trainer with no restarts seen: a longer estimate, a wider interval.
    calm = Trainer(step=1.0, block=0.5, slow=0.0, commit_steps=1, history=FailureHistory(96, 0))
    relaxed = Goodput()
    calm.run(relaxed, 40)
    assert relaxed.mtbf_estimate_seconds == pytest.approx(96 + calm.now, abs=1.0)
    assert relaxed.interval_seconds > 1.9 * policy.interval_seconds
    # A young job with no record (an older daemon): its own life so far, so it saves
    # about as often as Continuous() at first.
    young = Trainer(step=1.0, block=0.5, slow=0.0, commit_steps=1)
    fresh = Goodput()
    young.run(fresh, 8)
    assert fresh.mtbf_estimate_seconds is not None and fresh.mtbf_estimate_seconds < 10
    assert fresh.interval_seconds < 3.5


def test_node_losses_only() -> None:
    # Node losses every 100 s, saves measured until DURABLE (8 steps of 1 s).
    trainer = Trainer(step=1.0, block=0.5, slow=0.0, commit_steps=7)
    policy = Goodput(math.inf, node_mtbf_seconds=100.0, stage="durable")
    trainer.run(policy, 200)
    assert policy.interval_seconds == pytest.approx(
        math.sqrt(2 * 0.5 * (1 - 8.5 / 100) * 100), rel=0.02
    )
    with pytest.raises(ValueError, match="counts no failures"):
        Goodput(math.inf)
    assert optimal_interval(1.0, None) == math.inf


RESTORE = """
import sys
from ckptd.client import Client
c = Client("learn", socket=sys.argv[1])
c.restore(c.latest_step())
c.restore(c.latest_step())  # the same process again: not another restart
c.close()
"""


def test_the_daemon_counts_each_restarted_process_once(daemon: Any) -> None:
    client = daemon.client("learn")
    assert client._history() is None  # never seen: nothing to learn from yet
    client.save(1, {"w": np.arange(4.0)}).wait("local")
    seen = client._history()
    assert seen is not None and seen.restarts == 0 and seen.observed_seconds >= 0
    for _ in range(2):  # two trainer restarts: a new process restores each time
        subprocess.run([sys.executable, "-c", RESTORE, str(daemon.socket)], check=True)
    fresh = daemon.client("learn")
    history = fresh._history()
    assert history is not None and history.restarts == 2
    assert history.observed_seconds >= seen.observed_seconds


def test_the_client_default_is_goodput_learning_from_the_daemon(daemon: Any) -> None:
    client = daemon.client("default")
    policy = client.policy
    assert isinstance(policy, Goodput) and policy.mtbf_seconds is None
    # Three warm-up steps are timed first; then the first save (nothing measured yet).
    assert [client.should_save(s) for s in range(4)] == [False, False, False, True]
    client.save(3, {"w": np.arange(4.0)}).wait("local")
    client.should_save(4)  # the save is LOCAL: its cost is measured, the MTBF asked for
    assert policy.save_cost_seconds is not None
    # Learned from the daemon's record: seen moments ago, no restart, so a short MTBF.
    assert policy.mtbf_estimate_seconds is not None and policy.mtbf_estimate_seconds < 3600


def test_a_window_s_statistic_is_the_one_sorting_would_give() -> None:
    import random

    from ckptd.client.window import Window

    rng = random.Random(5)
    median, quartile = Window(8), Window(64, 0.25)
    assert median.stat() is None and quartile.stat() is None
    values: list[float] = []
    for _ in range(200):
        v = rng.random()
        values.append(v)
        median.append(v)
        quartile.append(v)
        last8, last64 = sorted(values[-8:]), sorted(values[-64:])
        want = (last8[(len(last8) - 1) // 2] + last8[len(last8) // 2]) / 2
        assert median.stat() == pytest.approx(want)
        assert quartile.stat() == last64[(len(last64) - 1) // 4]  # read twice: cached
        assert quartile.stat() == last64[(len(last64) - 1) // 4]
    assert len(median) == 8 and list(median) == values[-8:]
