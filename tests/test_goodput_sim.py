"""The goodput simulator (bench/goodput/sim.py, sim_run.py): deterministic, its
skip-ahead exact, its closed-form cases right, and the oracle the best fixed interval."""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from ckptd.client.goodput import Goodput
from ckptd.client.policies import (
    Continuous,
    FailureHistory,
    FixedInterval,
    SaveContext,
    SavePolicy,
)

from .helpers import GOODPUT_DIR, load_goodput

sim = load_goodput("sim")
sim_run = load_goodput("sim_run")
sim_inputs = load_goodput("sim_inputs")


def goodputs(make: Any, costs: Any, traces: Any, horizon: float) -> list[float]:
    """One arm's goodput on each trace."""
    return [r["goodput"] for r in sim_run.run_arm(make, costs, traces, horizon)]


def exact_costs(**changes: object) -> object:
    """The default costs with every spread removed (closed forms hold exactly)."""
    costs = sim.Costs.load()
    fixed: dict[str, object] = {
        f.name: sim.Dist(getattr(costs, f.name).median)
        for f in dataclasses.fields(costs)
        if isinstance(getattr(costs, f.name), sim.Dist)
    }
    fixed.update({k: sim.Dist(v) for k, v in changes.items()})
    return sim.Costs(**fixed)


def test_same_seed_same_result_and_seeds_differ() -> None:
    costs = sim.Costs.load()
    trace = sim.failure_trace(600, 3600, seed=3)
    assert trace == sim.failure_trace(600, 3600, seed=3)
    assert trace != sim.failure_trace(600, 3600, seed=4)
    one = sim.simulate(Goodput, costs, trace, 3600, seed=3)
    assert one == sim.simulate(Goodput, costs, trace, 3600, seed=3)
    assert one != sim.simulate(Goodput, costs, trace, 3600, seed=4)


@pytest.mark.parametrize(
    ("make", "mtbf", "skips"),
    [
        (Goodput, 20000.0, True),  # learned: long intervals once hours are seen
        (lambda: Goodput(mtbf_seconds=86400), 20000.0, True),
        (lambda: Goodput(mtbf_seconds=1800), 1800.0, False),
        (lambda: FixedInterval(37), 1800.0, True),
        (Continuous, 1800.0, False),
    ],
)
def test_skipping_quiet_steps_changes_nothing(make: object, mtbf: float, skips: bool) -> None:
    costs = sim.Costs.load()
    trace = sim.failure_trace(mtbf, 4 * 3600, seed=5, node_fraction=0.3)
    fast = sim.simulate(make, costs, trace, 4 * 3600, seed=5, skip=True)
    slow = sim.simulate(make, costs, trace, 4 * 3600, seed=5, skip=False)
    assert (fast.pop("skipped_steps") > 0) == skips
    assert slow.pop("skipped_steps") == 0
    assert fast == pytest.approx(slow, rel=1e-9)


def test_no_failures_fixed_interval_is_the_closed_form() -> None:
    costs = exact_costs()
    k, horizon = 20, 6 * 3600.0
    got = sim.simulate(lambda: FixedInterval(k), costs, [], horizon, seed=1)["goodput"]
    period = k * costs.step.median + costs.save_cost  # k steps and one save's cost
    assert got == pytest.approx(k * costs.step.median / period, abs=2e-4)
    assert got == pytest.approx(1 - costs.save_cost / (k * costs.step.median), abs=2e-3)


def test_the_oracle_beats_every_fixed_interval_on_its_traces() -> None:
    costs, horizon, mtbf = sim.Costs.load(), 2 * 3600.0, 600.0
    traces = [(s, sim.failure_trace(mtbf, horizon, s)) for s in range(3)]
    best, runs, _tried = sim_run.oracle_runs(costs, traces, horizon, mtbf)
    per_trace = [r["goodput"] for r in runs]
    ours = statistics.fmean(per_trace)
    for k in (1, 2, 4, 7, 10, 13, 16, 19, 22, 26, 32, 45, 70, 120):
        fixed = goodputs(lambda k=k: FixedInterval(k), costs, traces, horizon)
        assert ours >= statistics.fmean(fixed) - 1e-12, k
    assert 5 <= best <= 40


def test_goodput_told_the_mtbf_lands_near_the_oracle() -> None:
    costs, horizon, mtbf = sim.Costs.load(), 8 * 3600.0, 600.0
    traces = [(s, sim.failure_trace(mtbf, horizon, s)) for s in range(2)]
    _best, runs, _tried = sim_run.oracle_runs(costs, traces, horizon, mtbf)
    per_trace = [r["goodput"] for r in runs]
    told = goodputs(lambda: Goodput(mtbf_seconds=mtbf), costs, traces, horizon)
    assert statistics.fmean(told) == pytest.approx(statistics.fmean(per_trace), rel=0.01)


def test_a_node_loss_goes_back_to_the_newest_durable_save() -> None:
    # every 10 steps of 1 s; LOCAL in 0.3 s, an upload of 49.7 s: at t=100 the saves
    # of steps 10..90 are LOCAL, only step 10's is DURABLE (step 50's still uploads)
    costs = exact_costs(to_durable=50.0)
    lost = {}
    for node in (False, True):
        trace = [sim.Failure(100.0, node=node)]
        run = sim.simulate(lambda: FixedInterval(10), costs, trace, 200.0, seed=1)
        lost[node] = run["lost_seconds"]
    assert lost[False] == pytest.approx(8.0)  # step 98 back to step 90
    assert lost[True] == pytest.approx(88.0)  # back to step 10


def test_weibull_trace_keeps_the_mtbf_and_the_node_mix() -> None:
    trace = sim.failure_trace(100.0, 1e6, seed=2, shape=0.6, node_fraction=0.25)
    gaps = [b.at - a.at for a, b in itertools.pairwise(trace)]
    assert statistics.fmean(gaps) == pytest.approx(100.0, rel=0.05)
    assert statistics.stdev(gaps) > 1.3 * statistics.fmean(gaps)  # bursty, unlike shape 1
    assert sum(f.node for f in trace) / len(trace) == pytest.approx(0.25, abs=0.02)


def test_costs_per_arm_overlay_the_top_level_and_the_flat_format_is_ckptd(
    tmp_path: Path,
) -> None:
    flat = {
        "note": "old format",
        "step": 1.0,
        "save_blocking": 0.2,
        "save_effective": {"median": 0.1, "sigma": 0.3},
        "to_local": 0.3,
        "to_durable": {"samples": [4.0, 6.0]},
        "restart": 60.0,
        "node_restart": 300.0,
    }
    old = tmp_path / "flat.json"
    old.write_text(json.dumps(flat))
    assert sim.cost_arms(old) == ("ckptd",)
    ckptd = sim.Costs.load(old)
    assert ckptd == sim.Costs.load(old, arm="ckptd")
    assert ckptd.save_blocking == sim.Dist(0.2)
    assert ckptd.to_durable == sim.Dist(samples=(4.0, 6.0))
    with pytest.raises(ValueError, match=r"no costs for arm 'orbax'.*add an \"arms\""):
        sim.Costs.load(old, arm="orbax")

    top = {k: flat[k] for k in ("step", "restart", "node_restart")}
    arms = {
        "ckptd": {k: flat[k] for k in ("save_blocking", "save_effective", "to_local")},
        "orbax": {"save_blocking": 0.5, "save_effective": 2.0, "effective_spread_steps": 4}
        | {"to_local": 8.0, "to_durable": 8.0, "restart": 62.0},
    }
    arms["ckptd"]["to_durable"] = flat["to_durable"]
    new = tmp_path / "arms.json"
    new.write_text(json.dumps({"note": "new format", **top, "arms": arms}))
    assert sim.cost_arms(new) == ("ckptd", "orbax")
    assert sim.Costs.load(new) == ckptd  # the same costs, split between the levels
    orbax = sim.Costs.load(new, arm="orbax")
    assert (orbax.save_blocking, orbax.restart) == (sim.Dist(0.5), sim.Dist(62.0))
    assert orbax.node_restart == sim.Dist(300.0)  # not overridden: the top level's
    assert (orbax.effective_spread_steps, orbax.save_cost) == (4, 2.5)

    del arms["orbax"]["to_durable"]
    new.write_text(json.dumps({**top, "arms": arms}))
    with pytest.raises(ValueError, match="arm 'orbax': no to_durable"):
        sim.Costs.load(new, arm="orbax")


def test_the_default_costs_have_every_peer_arm() -> None:
    assert set(sim.cost_arms()) == {"ckptd", "orbax", "dcp", "dlrover"}
    ckptd, orbax = sim.Costs.load(), sim.Costs.load(arm="orbax")
    assert orbax.save_cost > ckptd.save_cost  # the measured ratios, not a copy
    assert orbax.to_durable == orbax.to_local  # Orbax commits to the remote directory
    assert sim.Costs.load(arm="dlrover").restart == ckptd.restart  # the top level's


def test_dlrover_restores_memory_after_a_trainer_failure_and_disk_after_a_node_loss() -> None:
    # steps of 1 s, a 0.1 s memory snapshot after each (step n's in memory at 1.1 n),
    # every 10th also to storage, a 10 s upload: step 10's durable at 21, step 20's
    # at 32, step 30's at 43, step 40's (in memory at 44) only at 54.
    costs = exact_costs(save_blocking=0.1, save_effective=0.0, to_local=0.1, to_durable=10.1)
    lost = {}
    for node in (False, True):
        trace = [sim.Failure(50.05, node=node)]  # in step 46 (49.5 .. 50.5)
        run = sim.simulate(lambda: sim.FlashCheckpoint(10), costs, trace, 100.0, seed=1)
        lost[node] = run["lost_seconds"]
    assert lost[False] == pytest.approx(0.0)  # step 45's snapshot, in memory
    assert lost[True] == pytest.approx(15.0)  # back to step 30, the newest on storage
    arm = sim_run.Arm("dlrover", durable_steps=10)
    assert (arm(), arm.costs, arm.serial) == (sim.FlashCheckpoint(10), "dlrover", False)


def test_serial_saves_wait_for_the_previous_commit() -> None:
    # every 10 steps of 1 s, each save committed 25 s after it starts: a save() that
    # waits for the previous one paces the trainer to 10 steps per 25 s
    costs = exact_costs(save_blocking=0.1, save_effective=0.0, to_local=25.0, to_durable=25.0)
    horizon = 5000.0
    run = sim.simulate(lambda: FixedInterval(10), costs, [], horizon, seed=1, serial=True)
    assert run["goodput"] == pytest.approx(10 / 25, abs=0.01)
    assert run["overhead"] == pytest.approx(15 / 25, abs=0.01)
    free = sim.simulate(lambda: FixedInterval(10), costs, [], horizon, seed=1)
    assert free["goodput"] == pytest.approx(10 / 10.1, abs=0.001)


def test_peer_arms_run_with_their_own_costs() -> None:
    ckptd = exact_costs()
    orbax = exact_costs(save_blocking=0.5, save_effective=0.0, to_local=2.0, to_durable=2.0)
    dlrover = exact_costs(save_blocking=0.05, save_effective=0.0, to_local=0.05)
    costs = {"ckptd": ckptd, "orbax": orbax, "dlrover": dlrover}
    got = sim_run.cell(costs, 600.0, 2 * 3600.0, 2, shape=1.0, node_fraction=0.5)
    arms = got["arms"]
    assert "dcp-yd" not in arms  # no dcp costs: no dcp arm
    assert {"orbax-continuous", "orbax-yd", "dlrover", "oracle"} <= set(arms)
    k = sim_run.young_daly_steps(orbax, 600.0)  # sqrt(2 * 0.5 * 600) = 24.5
    assert (arms["orbax-yd"]["steps"], got["young_daly_steps"], k) == (24, 15, 24)
    assert arms["orbax-yd"]["overhead"]["mean"] == pytest.approx(0.5 / 24.5, rel=0.05)
    assert arms["young-daly"]["overhead"]["mean"] == pytest.approx(0.18 / 15.18, rel=0.05)
    # DLRover tuned as its users would: memory at Young/Daly (sqrt(2 * 0.05 * 600) =
    # 7.7 s: every 8 steps), storage for the node losses alone, a multiple of it
    m = sim_run.young_daly_steps(dlrover, 600.0)
    assert (arms["dlrover"]["memory_steps"], m) == (m, 8)
    assert arms["dlrover"]["overhead"]["mean"] == pytest.approx(0.05 / 8.05, rel=0.1)
    n = sim_run.young_daly_steps(dlrover, 1200.0)
    assert arms["dlrover"]["durable_steps"] == max(round(n / m), 1) * m
    # orbax-continuous saves once each 2 s commit is in: 0.5 s every 3 steps or so
    assert arms["orbax-continuous"]["overhead"]["mean"] > 0.1
    text = sim_run.table([got])
    assert "| orbax-yd | " in text and "| 24 steps |" in text


def test_the_plot_has_a_panel_per_failure_mix(tmp_path: Path) -> None:
    sim_plot = load_goodput("sim_plot")
    arm = {"mean": 0.9, "ci95": 0.01}
    cells = [
        {"mtbf_seconds": m, "weibull_shape": 1.0, "node_fraction": f, "arms": {"goodput": arm}}
        | {"oracle_steps": 10}
        for m in (600, 3600)
        for f in (0.0, 0.3)
    ]
    results = tmp_path / "sim.json"
    results.write_text(json.dumps({"horizon_hours": 1, "traces": 2, "cells": cells}))
    out = sim_plot.plot(results)
    assert out == tmp_path / "sim.png" and out.read_bytes()[:4] == b"\x89PNG"
    assert sim_plot.panels(results) == [(1.0, 0.0), (1.0, 0.3)]
    results.write_text(json.dumps({"cells": []}))
    with pytest.raises(ValueError, match="no cells"):
        sim_plot.plot(results)


def test_skipping_quiet_steps_changes_nothing_for_serial_peer_saves() -> None:
    costs = sim.Costs.load(arm="orbax")  # commits in ~8 s: some saves wait at k = 5
    trace = sim.failure_trace(1800.0, 4 * 3600, seed=5, node_fraction=0.3)
    runs = [
        sim.simulate(lambda: FixedInterval(5), costs, trace, 4 * 3600, 5, skip=s, serial=True)
        for s in (True, False)
    ]
    assert runs[0].pop("skipped_steps") > 0 and runs[1].pop("skipped_steps") == 0
    assert runs[0] == pytest.approx(runs[1], rel=1e-9)


def test_sim_run_says_what_is_wrong_with_a_costs_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for text, says in (
        (None, "no costs file at"),
        ("{not json", "is not JSON"),
        ('{"arms": {"orbax": {}}}', "no costs for arm 'ckptd'"),
    ):
        path = tmp_path / "costs.json"
        if text is not None:
            path.write_text(text)
        with pytest.raises(SystemExit) as exit_:
            sim_run.main(["--costs", str(path), "--traces", "1"])
        assert exit_.value.code == 2
        assert says in capsys.readouterr().err


@dataclasses.dataclass(frozen=True)
class _PacedEvery(FixedInterval):
    """Saves every ``steps``, asking the drain for an upload pace, as the two-level
    ``Goodput()`` does."""

    upload_interval_seconds: float = 0.0


@pytest.mark.parametrize(("pace", "lost"), [(0.0, 14.0), (25.0, 34.0)])
def test_the_drain_keeps_the_upload_pace_a_policy_asks_for(pace: float, lost: float) -> None:
    # saves every 10 steps of 1 s, LOCAL 0.5 s after, a 5 s upload. Unpaced, step
    # n's is DURABLE at n + 5.5: at 64.5, step 50's. Paced to 25 s between upload
    # starts: step 10's goes at 10.5, 30's at 35.5 (20's superseded while it
    # waits), 50's at 60.5 (DURABLE only at 65.5): at 64.5 the newest is step 30's.
    costs = exact_costs(save_blocking=0.0, save_effective=0.0, to_local=0.5, to_durable=5.5)
    trace = [sim.Failure(64.5, node=True)]
    run = sim.simulate(lambda: _PacedEvery(10, pace), costs, trace, 100.0, seed=1)
    assert run["lost_seconds"] == pytest.approx(lost)


def test_the_nodes_record_keeps_a_young_job_from_saving_at_every_step() -> None:
    # Two failure-free hours of a new job on a node whose earlier jobs ran 3 days
    # with 12 restarts (MTBF 6 h): it saves at about tau*(6 h) from the start; with
    # no record it saves far more often while its own record is short.
    costs = exact_costs()
    alone = sim.simulate(Goodput, costs, [], 7200, seed=1)
    with_record = sim.simulate(Goodput, costs, [], 7200, seed=1, fleet=(3 * 86400.0, 12))
    assert with_record["saves"] < alone["saves"] / 3
    assert with_record["overhead"] < alone["overhead"]


def test_the_simulated_record_gives_the_restarts_times() -> None:
    record = sim._Record(0.0, (3600.0, 2))
    for t in (100.0, 250.0):
        record.restarted(t)
    record.now = 300.0
    seen = record.history()
    assert seen.restart_ages == (50.0, 200.0) and seen.restarts == 2
    assert (seen.fleet_observed_seconds, seen.fleet_restarts) == (3600.0, 2)


class _Watch(SavePolicy):
    """Never saves; keeps each step's record of failures, as the policy sees it."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, FailureHistory | None]] = []

    def should_save(self, ctx: SaveContext) -> bool:
        self.seen.append((ctx.now, ctx.history()))
        return False


def test_a_node_loss_keeps_the_buckets_record_of_the_node_name() -> None:
    # A node loss at 50 s (back about 300 s later): the new node's daemon starts the
    # job's record afresh, but the bucket's record of node names (1 h and 2
    # replacements besides this node's own time) survives it, one replacement more,
    # its time still counted from 0.
    watch = _Watch()
    trace = [sim.Failure(50.0, node=True)]
    sim.simulate(lambda: watch, exact_costs(), trace, 500.0, seed=1, node_fleet=(3600.0, 2))
    before = [(t, h) for t, h in watch.seen if t < 50.0]
    after = [(t, h) for t, h in watch.seen if t > 50.0]
    assert before and after
    for t, h in before + after:
        assert h is not None
        assert h.node_observed_seconds == pytest.approx(3600.0 + t)
    assert {h.node_replacements for _, h in before if h} == {2}
    assert {h.node_replacements for _, h in after if h} == {3}
    t, h = after[0]
    assert h is not None and h.observed_seconds < t - 50.0  # the job's record did not
    # Without a bucket record (the default): no node-seconds, as before.
    bare = _Watch()
    sim.simulate(lambda: bare, exact_costs(), trace, 500.0, seed=1)
    assert {h.node_observed_seconds for _, h in bare.seen if h} == {0.0}


def test_the_validation_predicts_each_real_run_on_its_own_kill_times() -> None:
    sim_validate = load_goodput("sim_validate")
    # the schedules the real harness ran (it records how many kills each had)
    real = json.loads((GOODPUT_DIR.parents[1] / "bench/results/goodput-gpu.json").read_text())
    for c in real["cells"]:
        got = sim_validate.kill_times(c["mtbf_s"], float(real["args"]["seconds"]), c["seed"])
        assert len(got) == c["kills"]
    results = {
        "args": {"seconds": "90"},
        "calibration": {"yd_cost_s": 0.5, "base_step_s": 1.0},
        "cells": [
            {"arm": arm, "mtbf_s": 60.0, "seed": seed, "goodput": g}
            for arm, seed, g in [
                ("ckptd-learned", 1, 0.9), ("ckptd-learned", 2, 0.95),
                ("orbax-yd", 1, 0.1), ("orbax-yd", 2, 0.2),
            ]
        ],
    }  # fmt: skip
    costs = {
        "ckptd": exact_costs(restart=1.0),
        "orbax": exact_costs(save_blocking=0.5, restart=1.0),
    }
    rows = {r["arm"]: r for r in sim_validate.validate(results, costs, repeats=2)}
    assert rows["ckptd-learned"]["schedules"] == 2
    assert 0.8 < rows["ckptd-learned"]["predicted_p50"] < 1.0
    # Orbax every 8 steps (sqrt(2 * 0.5 * 60) / 1): far above the made-up 0.1-0.2
    assert not rows["orbax-yd"]["agrees"] and rows["orbax-yd"]["predicted_p50"] > 0.5


def test_an_arm_measured_at_its_own_pace_runs_with_those_costs() -> None:
    # Orbax blocks far less when its saves follow each other (measured so): the
    # continuous arm takes its own section where the costs file has one.
    slow = exact_costs(save_blocking=0.5, save_effective=0.0, to_local=1.0, to_durable=1.0)
    fast = exact_costs(save_blocking=0.1, save_effective=0.0, to_local=1.0, to_durable=1.0)
    costs = {"ckptd": exact_costs(), "orbax": slow, "orbax-continuous": fast}
    arms = sim_run.cell(costs, 600.0, 3600.0, 1, shape=1.0, node_fraction=0.0)["arms"]
    assert arms["orbax-continuous"]["costs"] == "orbax-continuous"
    assert arms["orbax-yd"]["costs"] == "orbax"
    # a save of 0.1 s at every 1 s step (its commit is in by the step's end)
    assert arms["orbax-continuous"]["overhead"]["mean"] == pytest.approx(0.1 / 1.1, rel=0.05)


def test_each_save_draws_the_costs_measured_at_the_pace_nearest_its_own(
    tmp_path: Path,
) -> None:
    # The same stack measured saving every 8 s and every 2 s: a save's costs depend
    # on how long ago the previous one was (warm buffers, a commit still running).
    top = {"step": 1.0, "restart": 60.0, "node_restart": 300.0}
    save = {"save_effective": 0.0, "to_local": 0.5, "to_durable": 0.5}
    arms = {
        "ckptd": {"save_blocking": 0.3, "interval_s": 8.0, **save},
        "ckptd-every-2": {"save_blocking": 0.05, "interval_s": 2.0, "pace_of": "ckptd", **save},
    }
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({**top, "arms": arms}))
    costs = sim.Costs.load(path)
    assert [c.interval_s for c in costs.paces] == [2.0]
    assert costs.at(2.4).save_blocking == sim.Dist(0.05)
    assert costs.at(6.0).save_blocking == costs.at(None).save_blocking == sim.Dist(0.3)
    # A policy saving every 2 steps (1 s each) pays the 2-s pace's blocking per save.
    run = sim.simulate(lambda: FixedInterval(2), costs, [], 3600.0, seed=1)
    assert run["overhead"] == pytest.approx(0.05 / 2.05, rel=0.02)
    run = sim.simulate(lambda: FixedInterval(8), costs, [], 3600.0, seed=1)
    assert run["overhead"] == pytest.approx(0.3 / 8.3, rel=0.02)
    # An arm without paces, or with a pace of unknown interval, keeps its own costs.
    arms["ckptd"].pop("interval_s")
    path.write_text(json.dumps({**top, "arms": arms}))
    assert sim.Costs.load(path).at(2.0).save_blocking == sim.Dist(0.3)


def test_a_life_s_first_saves_draw_their_own_costs(tmp_path: Path) -> None:
    top = {"step": 1.0, "restart": 5.0, "node_restart": 300.0}
    ckptd = {"save_blocking": 0.1, "save_effective": 0.0, "to_local": 0.5, "to_durable": 0.5}
    ckptd["first_saves"] = [{"save_blocking": 2.0}, {"save_blocking": 1.0}]  # type: ignore[assignment]
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({**top, "arms": {"ckptd": ckptd}}))
    costs = sim.Costs.load(path)
    assert [costs.for_save(n, 4.0).save_blocking.median for n in (1, 2, 3, 9)] == [2, 1, 0.1, 0.1]
    assert costs.for_save(1, None).to_local == sim.Dist(0.5)  # the rest: the section's
    # One life of 100 steps saving every 10: 2 + 1 + 8 x 0.1 s blocked.
    run = sim.simulate(lambda: FixedInterval(10), costs, [], 103.8, seed=1)
    assert run["saves"] == 10
    assert run["overhead"] * run["wall_seconds"] == pytest.approx(3.8)
    # A restart begins a new life: its first saves are slow again.
    again = sim.simulate(lambda: FixedInterval(10), costs, [sim.Failure(50.5)], 200.0, seed=1)
    assert again["failures"] == 1
    assert again["overhead"] > run["overhead"]
    ckptd["first_saves"] = {"save_blocking": 2.0}  # type: ignore[assignment]
    path.write_text(json.dumps({**top, "arms": {"ckptd": ckptd}}))
    with pytest.raises(ValueError, match="first_saves must be a list"):
        sim.Costs.load(path)


def test_a_rate_that_changes_is_phases_of_their_own_mtbf(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A quiet day, a bad one (a failure every 10 minutes), a quiet day again.
    phases = [(21600.0, 86400.0), (600.0, 86400.0), (21600.0, 86400.0)]
    counts = [0, 0, 0]
    for seed in range(20):
        trace = sim_inputs.phased_trace(phases, seed)
        assert trace == sorted(trace, key=lambda f: f.at) and trace[-1].at < 3 * 86400
        for f in trace:
            counts[int(f.at // 86400)] += 1
    assert counts[1] / 20 == pytest.approx(144, rel=0.1)  # 86400 / 600
    assert counts[0] / 20 < 10 and counts[2] / 20 < 10
    assert sim_inputs.mean_mtbf(phases) == pytest.approx(3 * 86400 / (4 + 144 + 4))
    got = sim_run.cell(
        exact_costs(), 1800.0, 7200.0, 2, 1.0, 0.0, phases=[(3600.0, 3600.0), (300.0, 3600.0)]
    )
    assert got["phases"] == [(3600.0, 3600.0), (300.0, 3600.0)]
    assert got["arms"]["goodput"]["mean"] > 0
    with pytest.raises(SystemExit):
        sim_run.main(["--phases", "600x24,abc"])
    assert "MTBF-seconds x hours" in capsys.readouterr().err
