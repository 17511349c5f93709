"""The goodput simulator (bench/goodput/sim.py, sim_run.py): deterministic, its
skip-ahead exact, its closed-form cases right, and the oracle the best fixed interval."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import statistics
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ckptd.client.goodput import Goodput
from ckptd.client.policies import Continuous, FixedInterval

GOODPUT_DIR = Path(__file__).resolve().parents[1] / "bench" / "goodput"


def _load(name: str) -> ModuleType:
    """A bench/goodput script as a module (bench/ is scripts, not a package)."""
    for extra in (GOODPUT_DIR, GOODPUT_DIR.parent):
        if str(extra) not in sys.path:
            sys.path.insert(0, str(extra))
    spec = importlib.util.spec_from_file_location(name, GOODPUT_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


sim = _load("sim")
sim_run = _load("sim_run")


def exact_costs(**changes: object) -> object:
    """The default costs with every spread removed (closed forms hold exactly)."""
    costs = sim.Costs.load()
    fixed: dict[str, object] = {
        f.name: sim.Dist(getattr(costs, f.name).median)
        for f in dataclasses.fields(costs)
        if f.name != "effective_spread_steps"
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
    best, per_trace, _tried = sim_run.oracle(costs, traces, horizon, mtbf)
    ours = statistics.fmean(per_trace)
    for k in (1, 2, 4, 7, 10, 13, 16, 19, 22, 26, 32, 45, 70, 120):
        fixed = sim_run.run_traces(lambda k=k: FixedInterval(k), costs, traces, horizon)
        assert ours >= statistics.fmean(fixed) - 1e-12, k
    assert 5 <= best <= 40


def test_goodput_told_the_mtbf_lands_near_the_oracle() -> None:
    costs, horizon, mtbf = sim.Costs.load(), 8 * 3600.0, 600.0
    traces = [(s, sim.failure_trace(mtbf, horizon, s)) for s in range(2)]
    _best, per_trace, _tried = sim_run.oracle(costs, traces, horizon, mtbf)
    told = sim_run.run_traces(lambda: Goodput(mtbf_seconds=mtbf), costs, traces, horizon)
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
