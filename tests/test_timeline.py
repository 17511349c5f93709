"""A job's timelines: a save at or below the newest step (a rollback, a rerun under a
reused job name) keeps every new save; the steps it leaves behind are listed as
abandoned and kept by their own rule (docs/reliability.md, Timelines)."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client.handle import SaveHandle
from ckptd.core import timeline as tl
from ckptd.core.errors import Conflict
from ckptd.core.manifest import Manifest, RankRecord
from ckptd.daemon.catalog import LOCAL, Catalog
from ckptd.daemon.retention.plan import StepView, plan_job
from ckptd.daemon.retention.policies import KeepLatest
from ckptd.proto import ckptd_pb2 as pb

from .conftest import CKPTD, Daemon, RemoteTarget
from .test_remote_tier import remote_daemon


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _catalog() -> Catalog:
    clock = itertools.count(100.0)
    return Catalog("node-a", clock=lambda: float(next(clock)))


def _commit(c: Catalog, step: int) -> None:
    st = c.begin("j", step)
    m = Manifest(
        job="j",
        step=step,
        node="node-a",
        world_size=1,
        created_unix=1000.0 + step,
        ranks=[RankRecord(0, "rank-00000.safetensors", 4096, 7, None)],
        timeline=st.timeline,
        forks=st.forks,
    )
    c.committed(st, m)


def _state(c: Catalog) -> list[tuple[int, int, bool]]:
    return [(s.step, s.timeline, s.abandoned) for s in c.list("j")]


# -- the rule, alone ------------------------------------------------------------------
def test_lineage_rules() -> None:
    forks = tl.merge([(1, 10)], [(2, 5), (1, 12)])
    assert forks == ((1, 10), (2, 5))
    assert tl.abandoned(0, 10, forks) and tl.abandoned(0, 7, forks)  # by timeline 2
    assert not tl.abandoned(0, 4, forks) and not tl.abandoned(2, 100, forks)
    assert tl.abandoned(1, 5, forks) and not tl.abandoned(1, 4, forks)
    assert tl.newest(forks) == 2 and tl.newest((), [0]) == 0
    assert tl.check_forks([[1, 3], [2, 0]]) == ((1, 3), (2, 0))
    for bad in ([[0, 3]], [[1, 3], [1, 4]], [[1, -1]], [[1]], "x", [[True, 2]]):
        with pytest.raises(Exception, match=r"forks|timeline|step"):
            tl.check_forks(bad)


def test_a_holder_is_named_on_its_referrers_own_history() -> None:
    # A rollback to 30 (timeline 1), then a rerun from 10 (timeline 2).
    forks = ((1, 30), (2, 10))
    assert tl.timeline_at(20, 0, ()) == 0  # no fork: the first timeline
    assert tl.timeline_at(20, 1, forks) == 0 and tl.timeline_at(35, 1, forks) == 1
    assert tl.timeline_at(5, 2, forks) == 0 and tl.timeline_at(35, 2, forks) == 2
    assert tl.timeline_at(30, 2, forks) == 2 and tl.timeline_at(30, 1, forks) == 1
    assert tl.timeline_at(30, 0, forks) == 0  # later forks never name a step of an older one


def test_a_save_below_the_newest_step_begins_a_timeline_and_is_told_once() -> None:
    async def body() -> None:
        c = _catalog()
        for step in (100, 101, 102):
            _commit(c, step)
        _commit(c, 1)  # a rerun under the same job name
        assert _state(c) == [(1, 1, False), (102, 0, True), (101, 0, True), (100, 0, True)]
        told = [e for e in c.events() if e.kind == pb.STEP_EVENT_TIMELINE]
        assert [(e.step, dict(e.attributes)) for e in told] == [
            (1, {"timeline": "1", "abandoned": "100,101,102"})
        ]
        _commit(c, 2)  # the new timeline goes on: no new fork
        assert c.lineage("j") == ((1, 1),)
        assert [s.step for s in c.live("j")] == [2, 1]
        assert len([e for e in c.events() if e.kind == pb.STEP_EVENT_TIMELINE]) == 1

    _run(body())


def test_a_rollback_replaces_the_step_under_its_number_and_keeps_older_steps_live() -> None:
    async def body() -> None:
        c = _catalog()
        for step in (10, 20, 30, 40):
            _commit(c, step)
        old30 = c.require("j", 30)
        new30 = c.begin("j", 30)  # restored step 20, trained on, saved 30 again
        assert c.replacing(new30) is old30  # its local copy goes before the new commits
        assert c.require("j", 30) is new30 and new30.timeline == 1
        assert _state(c) == [(30, 1, False), (20, 0, False), (10, 0, False), (40, 0, True)]
        assert [e.step for e in c.events() if e.kind == pb.STEP_EVENT_REPLACED] == [30]
        c.replaced(old30)
        assert c.replacing(new30) is None and not old30.local

    _run(body())


def test_a_fork_whose_only_save_failed_is_forgotten() -> None:
    async def body() -> None:
        c = _catalog()
        for step in (5, 6):
            _commit(c, step)
        st = c.begin("j", 1)
        assert c.require("j", 6).abandoned
        c.failed(st, "writing rank 0 failed", "local")
        assert _state(c) == [(1, 1, False), (6, 0, False), (5, 0, False)]
        again = c.begin("j", 7)  # above the live newest: timeline 0 goes on
        assert (again.timeline, again.forks) == (0, ())

    _run(body())


def test_a_pinned_step_refuses_a_save_that_would_replace_it() -> None:
    async def body() -> None:
        c = _catalog()
        _commit(c, 3)
        c.set_pinned(c.require("j", 3), True)
        with pytest.raises(Conflict, match=r"pinned.*unpin"):
            c.begin("j", 3)
        assert c.require("j", 3).state == LOCAL

    _run(body())


def test_a_blind_save_begins_a_timeline_above_any_the_bucket_can_hold_once() -> None:
    c = _catalog()
    _commit(c, 1)
    _commit(c, 2)
    c.blind("j")  # its next save could not read the bucket's steps of the job
    _commit(c, 3)
    blind = c.require("j", 3).timeline
    assert blind >= 100_000 and dict(c.lineage("j")) == {blind: 3}  # milliseconds
    assert _state(c) == [(3, blind, False), (2, 0, False), (1, 0, False)]  # nothing left
    _commit(c, 4)  # numbered above the bucket's now: as usual
    assert c.require("j", 4).timeline == blind
    c.blind("j")
    c.sighted("j")  # read after all
    _commit(c, 5)
    assert c.require("j", 5).timeline == blind
    c.blind("j")
    replayed = c.begin("j", 6, timeline=(blind, c.lineage("j")))  # a journal replay
    assert replayed.timeline == blind
    c.failed(replayed, "test", "write")
    _commit(c, 7)  # still blind: the replay was numbered before
    assert c.require("j", 7).timeline > blind
    assert tl.blind_timeline(tl.MAX_TIMELINE, 1.0) == tl.MAX_TIMELINE - 1  # bounded
    # A blind save that fails with nothing kept takes its fork along: the next is blind.
    c.blind("f")
    first = c.begin("f", 1)
    c.failed(first, "test", "write")
    again = c.begin("f", 1)
    assert again.timeline > first.timeline > 0 and dict(c.lineage("f")) == {again.timeline: 1}
    # A job this node's disk held at start-up numbers from it, as its other nodes do.
    rank = RankRecord(0, "rank-00000.safetensors", 4096, 7, None)
    m = Manifest(job="k", step=1, node="node-a", world_size=1, created_unix=1.0, ranks=[rank])
    c.recovered(m, pinned=False)
    c.blind("k")
    assert c.begin("k", 2).timeline == 0


def _views(spec: list[tuple[int, int, bool, str]]) -> list[StepView]:
    """(step, timeline, abandoned, tiers: "l", "r", "lr", "" for a save in flight)."""
    return [
        StepView(
            step=n,
            time=float(n),
            local="l" in where,
            remote="r" in where,
            pending="l" in where and "r" not in where,
            abandoned=gone,
            timeline=t,
        )
        for n, t, gone, where in spec
    ]


def test_retention_of_abandoned_steps() -> None:
    old = [(n, 0, True, "lr") for n in (100, 101, 102, 103)]
    # The new timeline's first save is still in flight: nothing abandoned goes yet.
    plan = plan_job(_views([(1, 1, False, ""), *old]), KeepLatest(2), KeepLatest(2), 0)
    assert plan.evict_local == [] and plan.evict_remote == [100, 101]
    assert plan.local_reasons[103] == ["abandoned", "until-the-new-timeline-commits"]
    # Committed: the local tier drops them; the bucket keeps the old run's latest 2.
    plan = plan_job(_views([(1, 1, False, "l"), *old]), KeepLatest(2), KeepLatest(2), 0)
    assert plan.evict_local == [100, 101, 102, 103]
    assert plan.evict_remote == [100, 101]
    assert plan.remote_reasons[103] == ["abandoned", "latest", "newest"]
    assert plan.local_reasons[1] == ["latest", "newest"]  # the live history as before
    # Never uploaded and not wanted by the bucket: never will be.
    unsent = [(n, 0, True, "l") for n in (100, 101, 102)]
    plan = plan_job(_views([(1, 1, False, "l"), *unsent]), KeepLatest(2), KeepLatest(1), 0)
    assert sorted(plan.supersede) == [100, 101] and plan.remote_wants == {1, 102}
    assert plan.local_reasons[102] == ["abandoned", "awaiting-upload"]
    # Without a bucket the local tier is the durable one: it keeps what its policy keeps
    # of the abandoned timeline, as the bucket would.
    plan = plan_job(_views([(1, 1, False, "l"), *unsent]), KeepLatest(2), None, 0)
    assert plan.evict_local == [100]
    assert plan.local_reasons[102] == ["abandoned", "latest", "newest"]


# -- a real daemon ---------------------------------------------------------------------
def _save(client: Any, step: int, value: float) -> None:
    client.save(step, {"w": np.full(1024, value, np.float32)}, {"step": step}).wait("local")


def _value(client: Any, step: int | None = None) -> tuple[int, float]:
    tree, meta = client.restore(step=step)
    return meta["step"], float(tree["w"][0])


def test_a_reused_job_name_keeps_every_new_save(daemon: Daemon) -> None:
    old = daemon.client("run-42")
    for step in (100, 101, 102):
        _save(old, step, float(step))
    new = daemon.client("run-42")  # a rerun under the same name, from scratch
    _save(new, 1, -1.0)
    assert _value(new) == (1, -1.0)  # not step 102 of the old run
    assert new.latest_step() == 1 and new.all_steps() == [1]
    rows = {c.step: c for c in new.list()}
    assert rows[1].state == "LOCAL" and rows[1].timeline == 1 and not rows[1].abandoned
    assert all(rows[n].abandoned and rows[n].timeline == 0 for n in (100, 101, 102))
    for step in range(2, 5):
        _save(new, step, -float(step))
    assert _value(new) == (4, -4.0)
    # The live history under the default local policy (latest 3; step 1 may still be
    # held for the evictor's next pass), the old run beside it.
    rows = [(c.step, c.abandoned) for c in new.list()]
    assert rows[:3] == [(4, False), (3, False), (2, False)]
    assert rows[-3:] == [(102, True), (101, True), (100, True)]
    assert _value(new, 101) == (101, 101.0)  # an abandoned step is still there by number
    told = daemon.events_of(pb.STEP_EVENT_TIMELINE, "run-42")
    assert [(e.step, dict(e.attributes)["abandoned"]) for e in told] == [(1, "100,101,102")]
    ls = subprocess.run(
        [CKPTD, "ls", "run-42", "--socket", str(daemon.socket)], capture_output=True, text=True
    )
    lines = {line.split()[1]: line for line in ls.stdout.splitlines()[1:]}
    assert "abandoned (timeline 0)" in lines["101"] and "timeline 1" in lines["4"], ls.stdout
    # Without a bucket the local tier keeps the old run as its policy would (latest 3):
    # only step 1 of the new timeline may go, for being older than 2..4.
    gone = [e.step for e in daemon.events_of(pb.STEP_EVENT_EVICTED_LOCAL, "run-42")]
    assert gone in ([], [1])


def test_a_rollback_replaces_the_step_under_its_number(daemon: Daemon) -> None:
    client = daemon.client("roll")
    for step in (10, 20, 30, 40):
        _save(client, step, float(step))
    assert _value(client, 20) == (20, 20.0)  # a loss spike: back to step 20
    _save(client, 30, 300.0)
    assert _value(client) == (30, 300.0)
    rows = {c.step: c for c in client.list()}
    assert (rows[30].timeline, rows[40].abandoned, rows[20].abandoned) == (1, True, False)
    assert [e.step for e in daemon.events_of(pb.STEP_EVENT_REPLACED, "roll")] == [30]
    manifest = json.loads((daemon.root / "roll" / "30" / "manifest.json").read_text())
    assert (manifest["timeline"], manifest["forks"]) == (1, [[1, 30]])
    _save(client, 40, 400.0)  # the abandoned 40 is replaced too, on the same timeline
    assert _value(client) == (40, 400.0)
    assert {c.step: c.timeline for c in client.list()}[40] == 1


def test_a_replacing_save_acknowledged_before_a_daemon_crash_is_replayed(
    daemon: Daemon,
) -> None:
    client = daemon.client("crash")
    for step in (1, 2, 3):
        _save(client, step, float(step))
    daemon.stop()
    daemon.env["CKPTD_FAILPOINTS"] = "write.begin=pause"
    daemon.start()
    client = daemon.client("crash")
    handle = client.save(2, {"w": np.full(1024, 22.0, np.float32)}, {"step": 2})
    daemon.wait_failpoint("write.begin")  # acknowledged (journaled), not yet written
    daemon.kill()
    daemon.env.pop("CKPTD_FAILPOINTS")
    daemon.start()
    client = daemon.client("crash")
    SaveHandle(client, handle.step).wait("local", timeout=60)
    assert _value(client) == (2, 22.0)  # the replayed save replaced the old step 2
    rows = {c.step: c for c in client.list()}
    assert rows[2].timeline == 1 and rows[3].abandoned


def test_the_bucket_follows_the_new_timeline_after_the_disk_is_lost(
    make_daemon: Any, tmp_path: Path
) -> None:
    bucket = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon = remote_daemon(make_daemon, bucket)
    client = daemon.client("lost")
    for step in (1, 2, 3):
        client.save(step, {"w": np.full(8, float(step), np.float32)}, {"step": step}).wait(
            "durable", timeout=60
        )
    client.save(2, {"w": np.full(8, 20.0, np.float32)}, {"step": 2}).wait("durable", timeout=60)
    marker = json.loads(
        (tmp_path / "bucket" / "lost" / "2" / "_complete" / "test-node").read_text()
    )
    assert (marker["timeline"], marker["forks"]) == (1, [[1, 2]])
    index = json.loads((tmp_path / "bucket" / "lost" / "_index" / "test-node.json").read_text())
    assert {e["step"]: e["timeline"] for e in index["steps"]}[2] == 1
    daemon.stop()
    shutil.rmtree(daemon.root)  # the node's disk is gone
    daemon.start()
    client = daemon.client("lost")
    assert _value(client) == (2, 20.0)  # the new timeline's step, not the old step 3
    assert {c.step: c.abandoned for c in client.list()} == {1: False, 2: False, 3: True}
    # A replacement node under a new name learns the lineage from the markers.
    other = remote_daemon(make_daemon, bucket, extra_args=["--node-id", "replacement"])
    assert _value(other.client("lost")) == (2, 20.0)
    # So does `ckptd pull` with no step: the newest of the live history, not step 3.
    dest = tmp_path / "pulled"
    pull = subprocess.run(
        [CKPTD, "pull", "lost", str(dest), "--remote", bucket.url], capture_output=True, text=True
    )
    assert pull.returncode == 0, pull.stderr
    assert json.loads((dest / "manifest.json").read_text())["step"] == 2


def test_a_pinned_step_refuses_a_save_under_its_number_and_leaves_nothing(
    daemon: Daemon,
) -> None:
    client = daemon.client("pinned")
    _save(client, 5, 5.0)
    client.pin(5)
    with pytest.raises(Conflict, match=r"pinned.*unpin"):
        client.save(5, {"w": np.zeros(1024, np.float32)}, {"step": 5})
    assert list((daemon.root / ".staging").iterdir()) == []
    assert daemon.status().leases_held == 0
    assert _value(client) == (5, 5.0)
    client.unpin(5)
    _save(client, 5, 50.0)  # unpinned: the save replaces it
    assert _value(client) == (5, 50.0)


def test_a_save_that_could_not_read_the_bucket_first_is_still_the_newest(
    make_daemon: Any, tmp_path: Path
) -> None:
    """A node that lost its disk saves before it could read its steps in the bucket (a
    slow or absent bucket): the save is blind, so it starts a timeline above any the
    bucket can hold, and once the bucket is read the older run is what is left behind."""
    bucket = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon = remote_daemon(make_daemon, bucket)
    client = daemon.client("blind")
    for step, value in ((1, 1.0), (2, 2.0), (3, 3.0), (2, 20.0)):  # 2 again: timeline 1
        client.save(step, {"w": np.full(8, value, np.float32)}, {"step": step}).wait(
            "durable", timeout=60
        )
    daemon.stop()
    shutil.rmtree(daemon.root)  # the node's disk is gone
    daemon.env["CKPTD_FAILPOINTS"] = "index.read_own=pause"  # the bucket does not answer
    daemon.start()
    client = daemon.client("blind")
    handle = client.save(1, {"w": np.full(8, -1.0, np.float32)}, {"step": 1})  # a rerun
    handle.wait("local", timeout=60)
    daemon.wait_failpoint("index.read_own")  # the save went on without the bucket's answer
    daemon.release("index.read_own")
    handle.wait("durable", timeout=60)
    assert _value(client) == (1, -1.0)  # not the older run's step 2
    rows = {c.step: c for c in client.list()}
    assert not rows[1].abandoned and rows[1].timeline > 1, rows
    assert rows[2].abandoned and rows[3].abandoned, rows
    # Another node loss, the bucket answering: it holds the same history.
    daemon.stop()
    shutil.rmtree(daemon.root)
    daemon.env.pop("CKPTD_FAILPOINTS")
    daemon.start()
    again = daemon.client("blind")
    assert _value(again) == (1, -1.0)
    assert {c.step: c.abandoned for c in again.list()} == {1: False, 2: True, 3: True}
