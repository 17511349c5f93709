"""Two levels: local saves at the interval trainer failures make worth it, an upload
every ``k``-th of them where uploads cost the trainer and node losses are rarer; the
daemon's drain keeps the pace the policy asks for (a real daemon and bucket)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from ckptd.client import Client
from ckptd.client.goodput import Goodput, optimal_interval, two_level_interval
from ckptd.client.policies import Continuous, SaveContext
from ckptd.daemon.lifecycle.pace import UploadPace
from ckptd.proto import ckptd_pb2 as pb

from .test_remote_tier import remote_daemon, s3_target


def test_free_uploads_go_with_every_save() -> None:
    tau, k = two_level_interval(2.0, 0.0, 600.0, 6000.0, 1.0, 10.0)
    assert k == 1
    assert tau == pytest.approx(optimal_interval(2.0, 600.0, 1.0, 6000.0, 10.0))


@pytest.mark.parametrize(("cost", "upload", "mtbf", "node"), [(1, 30, 600, 36000), (2, 5, 60, 600)])
def test_dear_uploads_go_with_every_kth_save(
    cost: float, upload: float, mtbf: float, node: float
) -> None:
    tau, k = two_level_interval(cost, upload, mtbf, node)

    # k minimises the overhead of the whole cycle over every whole number.
    def g(n: int) -> float:
        return (cost + upload / n) * (1 / mtbf + n / node)

    assert k > 1 and g(k) == min(g(n) for n in range(1, 200))
    assert tau == pytest.approx(math.sqrt(2 * (cost + upload / k) / (1 / mtbf + k / node)))


class Trainer:
    """Steps of 1 s; a save blocks 1 s and is LOCAL at the next step; its upload then
    slows each of the next ``upload_steps`` steps by ``slow`` until DURABLE."""

    def __init__(self, upload_steps: int, slow: float) -> None:
        self.upload_steps, self.slow = upload_steps, slow
        self.now, self.save_at, self.local, self.durable = 0.0, None, -1, -1

    def run(self, policy: Goodput, steps: int) -> None:
        last_step: int | None = None
        for step in range(steps):
            local, durable = self.local, self.durable

            def reached(
                stage: str, step: int = step, at: tuple[int, int] = (local, durable)
            ) -> bool:
                return step >= (at[0] if stage == "local" else at[1])

            ctx = SaveContext(step, self.now, last_step, self.save_at, reached)
            dt = 1.0 + (self.slow if local <= step < durable else 0.0)
            if policy.should_save(ctx):
                last_step, self.save_at = step, self.now
                self.local, self.durable = step + 1, step + 1 + self.upload_steps
                dt += 1.0
            self.now += dt


def test_the_policy_measures_the_upload_and_asks_for_a_pace() -> None:
    policy = Goodput(mtbf_seconds=300.0, node_mtbf_seconds=30000.0)
    Trainer(upload_steps=4, slow=2.0).run(policy, 400)
    assert policy.save_cost_seconds == pytest.approx(1.0)
    assert policy.upload_cost_seconds == pytest.approx(8.0)
    tau, k = two_level_interval(1.0, 8.0, 300.0, 30000.0, 1.0, 6.0)
    assert k > 1 and policy.interval_seconds == pytest.approx(tau, rel=0.05)
    assert policy.upload_interval_seconds == pytest.approx(k * policy.interval_seconds)
    # Node losses it is not told of: one level, as before, and no pace.
    single = Goodput(mtbf_seconds=300.0)
    Trainer(upload_steps=4, slow=2.0).run(single, 400)
    assert single.upload_interval_seconds == 0.0 and single.upload_cost_seconds is None


def test_the_pace() -> None:
    clock = [100.0]
    pace = UploadPace(lambda: clock[0])
    assert pace.ready("a") and pace.next_due({"a"}) == math.inf
    pace.ask("a", 10.0)
    pace.started("a")
    clock[0] += 4
    assert not pace.ready("a") and pace.next_due({"a", "b"}) == pytest.approx(6.0)
    clock[0] += 6
    assert pace.ready("a")
    pace.ask("a", 0.0)  # the job's next commit asks for no pace
    assert pace.interval("a") == 0.0 and pace.ready("a")


@dataclass(frozen=True)
class Paced(Continuous):
    """Continuous() that asks the drain for one upload every ``upload_interval_seconds``."""

    upload_interval_seconds: float = 0.0


def test_the_drain_keeps_the_pace_a_job_asks_for(make_daemon: Any, s3_server: Any) -> None:
    d = remote_daemon(make_daemon, s3_target(s3_server, "ckptd-paced"))
    client = Client("paced", socket=d.socket, policy=Paced(upload_interval_seconds=2.0))
    w = {"w": np.arange(64.0)}
    client.save(1, w).wait("durable")
    # Saved while the pace holds the job back: the milestone goes anyway, step 3 is
    # skipped for step 4, which goes when the pace allows.
    handles = [client.save(step, w, milestone=step == 2) for step in (2, 3, 4)]
    for h in handles:
        h.wait("local")
    handles[-1].wait("durable")
    states = {c.step: c.state for c in client.list()}
    assert states[2] == "DURABLE" and states[4] == "DURABLE" and states[3] == "SUPERSEDED"
    (skipped,) = d.events_of(pb.STEP_EVENT_SUPERSEDED, "paced", 3)
    assert "uploads at most every 2 s" in skipped.detail
    # Step 4's upload started no sooner than the pace after step 1's.
    (first,) = d.events_of(pb.STEP_EVENT_DRAINING, "paced", 1)
    (fourth,) = d.events_of(pb.STEP_EVENT_DRAINING, "paced", 4)
    assert fourth.time_unix - first.time_unix >= 2.0
    client.close()
