"""Two levels: local saves at the interval trainer failures make worth it, an upload
every ``k``-th of them where uploads cost the trainer and node losses are rarer; the
daemon's drain keeps the pace the policy asks for (a real daemon and bucket)."""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from ckptd.client import Client
from ckptd.client.goodput import Goodput, learned_node_mtbf, optimal_interval, two_level_interval
from ckptd.client.policies import Continuous, FailureHistory, SaveContext
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

    def __init__(
        self, upload_steps: int, slow: float, history: FailureHistory | None = None
    ) -> None:
        self.upload_steps, self.slow, self.history = upload_steps, slow, history
        self.now, self.save_at, self.local, self.durable = 0.0, None, -1, -1

    def run(self, policy: Goodput, steps: int) -> None:
        last_step: int | None = None
        for step in range(steps):
            local, durable = self.local, self.durable

            def reached(
                stage: str, step: int = step, at: tuple[int, int] = (local, durable)
            ) -> bool:
                return step >= (at[0] if stage == "local" else at[1])

            ctx = SaveContext(
                step, self.now, last_step, self.save_at, reached, lambda: self.history
            )
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


def test_the_node_mtbf_learned_from_the_bucket() -> None:
    assert learned_node_mtbf(FailureHistory(100.0, 0)) is None  # no bucket: no node level
    # 3 replacements in 40 node-hours: 10 h per node (the next loss counts as one).
    seen = FailureHistory(100.0, 0, node_observed_seconds=40 * 3600.0, node_replacements=3)
    assert learned_node_mtbf(seen) == pytest.approx(10 * 3600.0)
    # A job on 4 nodes loses one of them 4 times as often.
    spread = FailureHistory(
        100.0, 0, node_observed_seconds=40 * 3600.0, node_replacements=3, job_nodes=4
    )
    assert learned_node_mtbf(spread) == pytest.approx(2.5 * 3600.0)


def test_the_learned_node_mtbf_brings_two_levels_and_a_configured_one_wins() -> None:
    # Learned: 2 nodes, 180,000 node-seconds, 2 replacements: 30,000 s for the job.
    seen = FailureHistory(
        1000.0, 0, node_observed_seconds=180000.0, node_replacements=2, job_nodes=2
    )
    learned = Goodput(mtbf_seconds=300.0)
    Trainer(upload_steps=4, slow=2.0, history=seen).run(learned, 400)
    told = Goodput(mtbf_seconds=300.0, node_mtbf_seconds=30000.0)
    Trainer(upload_steps=4, slow=2.0).run(told, 400)
    assert learned.node_mtbf_estimate_seconds == pytest.approx(30000.0)
    assert learned.upload_cost_seconds == pytest.approx(8.0)
    assert learned.interval_seconds == pytest.approx(told.interval_seconds)
    assert told.upload_interval_seconds > 0
    assert learned.upload_interval_seconds == pytest.approx(told.upload_interval_seconds)
    # An explicit node MTBF wins over the record.
    wins = Goodput(mtbf_seconds=300.0, node_mtbf_seconds=30000.0)
    rare = FailureHistory(1000.0, 0, node_observed_seconds=1e9, node_replacements=0)
    Trainer(upload_steps=4, slow=2.0, history=rare).run(wins, 400)
    assert wins.node_mtbf_estimate_seconds == 30000.0
    assert wins.interval_seconds == pytest.approx(told.interval_seconds)
    # No bucket (0 node-seconds): one level, no pace, as without the record.
    alone = Goodput(mtbf_seconds=300.0)
    Trainer(upload_steps=4, slow=2.0, history=FailureHistory(1000.0, 0)).run(alone, 400)
    assert alone.node_mtbf_estimate_seconds is None
    assert alone.upload_interval_seconds == 0.0 and alone.upload_cost_seconds is None


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
    # Step 4's upload started no sooner than the pace after step 1's. The pace runs on
    # the monotonic clock from the upload's start, the events carry the wall clock of
    # their emission: the two differ by the few milliseconds between them (seen: 1.7 ms
    # on a loaded machine), which says nothing about the pace; an unpaced drain would
    # start step 4 at once.
    (first,) = d.events_of(pb.STEP_EVENT_DRAINING, "paced", 1)
    (fourth,) = d.events_of(pb.STEP_EVENT_DRAINING, "paced", 4)
    assert fourth.time_unix - first.time_unix >= 2.0 - 0.1
    client.close()


def test_a_node_replaced_on_a_new_disk_is_counted_in_the_job_history(
    make_daemon: Any, s3_server: Any
) -> None:
    """The node dies (SIGKILL, its disk wiped): the daemon started in its place on the
    new disk, under the same node name, takes the dead one's claim and tells its
    clients of one replacement, which the lost daemon's own record could not."""
    d = remote_daemon(make_daemon, s3_target(s3_server, "ckptd-replaced"))
    w = {"w": np.arange(64.0)}
    client = Client("lost", socket=d.socket)
    client.save(1, w).wait("durable")
    before = client.connection.list_checkpoints(pb.ListCheckpointsRequest(job="lost")).history
    assert before.node_replacements == 0 and before.node_observed_seconds > 0
    client.close()
    d.kill()
    shutil.rmtree(d.root)  # a new disk: a new root id
    d.start()
    again = Client("lost", socket=d.socket)
    assert again.restore() is not None  # from the bucket
    seen = again.connection.list_checkpoints(pb.ListCheckpointsRequest(job="lost")).history
    assert seen.node_replacements == 1
    assert seen.node_observed_seconds >= before.node_observed_seconds
    assert seen.node_names == 1  # its own claim (the fleet sample comes later)
    history = again._history()
    assert history is not None and history.node_replacements == 1
    # The client keeps the record between asks: the node names age as time passes.
    again._history_at -= 100.0  # as if asked 100 s ago
    later = again._history()
    assert later is not None
    assert later.node_observed_seconds >= history.node_observed_seconds + 100.0
    # A client of 8 ranks, 4 on this node: the job spans 2 nodes.
    wide = Client("lost", socket=d.socket, node_ranks=[0, 1, 2, 3], world_size=8)
    spread = wide._history()
    assert spread is not None and spread.job_nodes == 2
    wide.close()
    again.close()
