"""What ``Goodput()`` learns its failure rate from: the daemon's record of each job
(active time, restarts and their times, kept across daemon restarts), a prior from
the node's other jobs, and the newest restarts overruling the long run when the
rate changes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client import FailureHistory, Goodput
from ckptd.client.goodput import learned_mtbf
from ckptd.daemon.api.history import FILE_NAME, IDLE_GAP, MAX_JOBS, JobHistory


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_the_long_run_estimate_and_its_prior() -> None:
    # No prior: T / (n + 1), as before.
    assert learned_mtbf(FailureHistory(300, 2)) == pytest.approx(100)
    # A configured prior weighs as one failure interval: (T + M0) / (n + 1).
    assert learned_mtbf(FailureHistory(300, 2), prior_mtbf=3600) == pytest.approx(1300)
    # A young job on a node whose other jobs ran 10 h with 4 restarts: M0 = 2 h,
    # not the few seconds it has seen itself.
    young = FailureHistory(5, 0, fleet_observed_seconds=36000, fleet_restarts=4)
    assert learned_mtbf(young) == pytest.approx(7205)
    # ... and the configured prior wins over the node's record.
    assert learned_mtbf(young, prior_mtbf=60) == pytest.approx(65)
    # As the job's own record grows, it dominates the prior.
    old = FailureHistory(1_000_000, 99, fleet_observed_seconds=36000, fleet_restarts=4)
    assert learned_mtbf(old) == pytest.approx((1_000_000 + 7200) / 100)


def test_the_newest_restarts_overrule_the_long_run_when_the_rate_changes() -> None:
    # 3 days at one failure per hour, then a bad rack: 8 restarts in the last 16 min.
    bad = FailureHistory(72 * 3600, 80, restart_ages=tuple(120.0 * i + 60 for i in range(8)))
    assert learned_mtbf(bad) == pytest.approx((120 * 7 + 60) / 8)
    # The same 8 restarts spread at the old rate: the long run stands.
    steady = FailureHistory(72 * 3600, 80, restart_ages=tuple(3000.0 * i + 60 for i in range(8)))
    assert learned_mtbf(steady) == pytest.approx(72 * 3600 / 81)
    # A quiet week: no restart for 20 h where about one an hour was the rule.
    quiet = FailureHistory(92 * 3600, 72, restart_ages=(20 * 3600.0,))
    assert learned_mtbf(quiet) == pytest.approx(10 * 3600)
    # Fewer than 8 restarts never overrule towards shorter.
    few = FailureHistory(72 * 3600, 3, restart_ages=(10.0, 20.0, 30.0))
    assert learned_mtbf(few) == pytest.approx(72 * 3600 / 4)


def test_the_policy_takes_its_prior() -> None:
    with pytest.raises(ValueError, match="prior_mtbf_seconds must be > 0"):
        Goodput(prior_mtbf_seconds=0)
    assert Goodput(prior_mtbf_seconds=600).prior_mtbf_seconds == 600


def test_active_time_leaves_idle_gaps_out(tmp_path: Path) -> None:
    clock = Clock()
    h = JobHistory(tmp_path / FILE_NAME, clock)
    h.seen("a")
    clock.t += 100
    h.seen("a")
    clock.t += 50  # still in the stretch: counts up to now
    assert h.message("a").first_seen_unix == pytest.approx(clock.t - 150)
    clock.t += IDLE_GAP * 5  # the job ended; it runs again days later
    assert h.message("a").first_seen_unix == pytest.approx(clock.t - 100)
    h.seen("a")
    clock.t += 10
    assert h.message("a").first_seen_unix == pytest.approx(clock.t - 110)


def test_restarts_and_their_times_survive_a_daemon_restart(tmp_path: Path) -> None:
    clock = Clock()
    h = JobHistory(tmp_path / FILE_NAME, clock)
    for i, process in enumerate(["p1", "p2", "p2", "p3"]):
        clock.t += 60
        h.restored("a", 0, process)
        h.restored("a", 1, f"{process}-rank1")  # ranks restart together: one restart
        assert h.restarts("a") == min(i + 1, 2) + (i == 3)
    h.seen("b")
    clock.t += 30
    first = h.message("a")
    assert first.restarts == 3
    assert list(first.restart_unix) == [clock.t - 210, clock.t - 150, clock.t - 30]
    h.close()
    again = JobHistory(tmp_path / FILE_NAME, clock)  # the next daemon on this root
    msg = again.message("a")
    assert (msg.restarts, list(msg.restart_unix)) == (3, list(first.restart_unix))
    assert msg.first_seen_unix == pytest.approx(first.first_seen_unix)
    # The other job sees this one as the node's record: its prior.
    other = again.message("b")
    assert (other.fleet_restarts, other.fleet_observed_seconds) == (3, pytest.approx(210))
    assert other.restarts == 0


def test_an_unreadable_record_is_set_aside(tmp_path: Path, caplog: Any) -> None:
    path = tmp_path / FILE_NAME
    path.write_text('{"version": 1, "jobs": {"a": {"first_seen": "x"}}}')
    h = JobHistory(path, Clock())
    assert h.message("a").first_seen_unix == 0
    assert "set aside" in caplog.text and path.with_name(FILE_NAME + ".unreadable").exists()
    h.seen("a")
    h.close()
    assert json.loads(path.read_text())["jobs"]["a"]["restores"] == {}


def test_the_record_is_bounded(tmp_path: Path) -> None:
    clock = Clock()
    h = JobHistory(tmp_path / FILE_NAME, clock)
    for i in range(MAX_JOBS + 5):
        clock.t += 1
        h.seen(f"j{i}")
    h.close()
    jobs = json.loads((tmp_path / FILE_NAME).read_text())["jobs"]
    assert len(jobs) == MAX_JOBS and "j0" not in jobs and f"j{MAX_JOBS + 4}" in jobs


RESTORE = """
import sys
from ckptd.client import Client
c = Client(sys.argv[2], socket=sys.argv[1])
c.restore(c.latest_step())
c.close()
"""


def test_a_restarted_daemon_remembers_and_a_new_job_starts_from_the_node(daemon: Any) -> None:
    client = daemon.client("learn")
    client.save(1, {"w": np.arange(4.0)}).wait("local")
    for _ in range(2):  # two trainer restarts
        subprocess.run([sys.executable, "-c", RESTORE, str(daemon.socket), "learn"], check=True)
    client.close()
    assert daemon.stop() == 0
    daemon.restart()
    seen = daemon.client("learn")._history()
    assert seen is not None and seen.restarts == 2 and len(seen.restart_ages) == 2
    assert seen.restart_ages[0] <= seen.restart_ages[1]  # newest first
    # A new job on this node: the node's record is its prior, not nothing.
    fresh = daemon.client("fresh")
    fresh.save(1, {"w": np.arange(4.0)}).wait("local")
    prior = fresh._history()
    assert prior is not None and prior.restarts == 0 and prior.fleet_restarts == 2
    assert prior.fleet_observed_seconds >= seen.observed_seconds
    # No bucket: no record of node names, so no node level (as without the record).
    assert (prior.node_observed_seconds, prior.node_replacements) == (0.0, 0)


HONEST_NODES = FailureHistory(100.0, 0, node_observed_seconds=17 * 3600.0, node_replacements=1)
"""A young job on a node whose name has been claimed 17 h, one node lost."""
POISONED: dict[str, FailureHistory] = {
    "node seconds NaN": FailureHistory(100.0, 0, node_observed_seconds=math.nan),
    "node seconds inf": FailureHistory(100.0, 0, node_observed_seconds=math.inf),
    "node seconds negative": FailureHistory(100.0, 0, node_observed_seconds=-1e300),
    "replacements huge": FailureHistory(
        100.0, 0, node_observed_seconds=3600, node_replacements=10**30
    ),
    "active time NaN": FailureHistory(math.nan, 0),
    "active time inf": FailureHistory(math.inf, 0),
    "active time huge": FailureHistory(1e300, 0),
    "restarts negative": FailureHistory(100.0, -5),
    "restart ages NaN": FailureHistory(100.0, 8, restart_ages=(math.nan,) * 8),
    "fleet NaN": FailureHistory(100.0, 0, fleet_observed_seconds=math.nan, fleet_restarts=3),
    "fleet huge": FailureHistory(100.0, 0, fleet_observed_seconds=1e300),
    "job nodes 0": FailureHistory(100.0, 0, node_observed_seconds=3600, job_nodes=0),
}


def _saves(
    seen: FailureHistory, steps: int = 40, policy: Goodput | None = None
) -> tuple[int, Goodput]:
    """Saves ``policy`` (the default, as ``Client(job)`` has it) makes in ``steps``
    steps of a trainer whose daemon sends ``seen`` (tests/test_goodput_two_levels.py's
    trainer: 1 s steps, uploads that slow the next steps)."""
    from .test_goodput_two_levels import Trainer

    policy = policy or Goodput()
    decide = policy.should_save
    made: list[bool] = []

    def counted(ctx: Any) -> bool:
        made.append(decide(ctx))
        return made[-1]

    policy.should_save = counted  # type: ignore[method-assign]
    Trainer(upload_steps=2, slow=0.5, history=seen).run(policy, steps)
    return sum(made), policy


@pytest.mark.parametrize("poison", sorted(POISONED))
def test_no_history_a_daemon_sends_stops_the_policy_saving(poison: str) -> None:
    """Values no honest daemon sends (a bucket's poisoned node record passed on, a
    daemon of another release) are read as unknown, which errs towards saving: the
    policy saves at least as often as with an honest record, at a finite interval."""
    honest, _ = _saves(HONEST_NODES)
    assert honest >= 2
    saved, policy = _saves(POISONED[poison])
    assert saved >= honest, (saved, honest)
    assert math.isfinite(policy.interval_seconds) and policy.interval_seconds >= 0
    estimates = (policy.mtbf_estimate_seconds, policy.node_mtbf_estimate_seconds)
    assert all(e is None or (math.isfinite(e) and e > 0) for e in estimates), estimates


def test_an_infinite_node_mtbf_counts_no_node_losses() -> None:
    """``node_mtbf_seconds=inf`` is what ``mtbf_seconds=inf`` is: not counted."""
    without, _ = _saves(FailureHistory(100.0, 0), 200, Goodput(mtbf_seconds=60.0))
    saved, policy = _saves(
        FailureHistory(100.0, 0), 200, Goodput(mtbf_seconds=60.0, node_mtbf_seconds=math.inf)
    )
    assert saved == without and policy.node_mtbf_estimate_seconds is None
