"""Retention policies, the eviction plan and save-decision policies: table-driven units."""

from __future__ import annotations

from typing import Any

import pytest

from ckptd.client.policies import AnyOf, Continuous, FixedInterval, SaveContext, SpecificSteps
from ckptd.daemon.app.config import ConfigError, load
from ckptd.daemon.local.admission import SpaceMark
from ckptd.daemon.retention.plan import StepView, plan_job
from ckptd.daemon.retention.policies import (
    Checkpoint,
    KeepAll,
    KeepAny,
    KeepBest,
    KeepEverySeconds,
    KeepEverySteps,
    KeepLatest,
    KeepMilestones,
    KeepSteps,
    Policy,
    PolicyError,
    parse_policy,
)


def ckpts(steps: list[int], times: list[float] | None = None, **kw: Any) -> list[Checkpoint]:
    times = times or [float(s) for s in steps]
    return [Checkpoint(s, t, **kw) for s, t in zip(steps, times, strict=True)]


# -- one table per policy: (policy, checkpoints, kept steps) ---------------------------
@pytest.mark.parametrize(
    ("policy", "steps", "kept"),
    [
        (KeepLatest(2), [0, 1, 2, 3], [2, 3]),
        (KeepLatest(2), [3, 0, 2, 1], [2, 3]),  # order of the input does not matter
        (KeepLatest(5), [0, 1], [0, 1]),
        (KeepLatest(0), [0, 1, 2], []),
        (KeepLatest(1), [], []),
    ],
)
def test_keep_latest(policy: Policy, steps: list[int], kept: list[int]) -> None:
    assert sorted(policy.keep(ckpts(steps), now=0.0)) == kept


@pytest.mark.parametrize(
    ("k", "steps", "kept"),
    [
        (10, list(range(25)), [0, 10, 20]),
        (3, [1, 2, 4, 5, 7], []),
        (1, [4, 5], [4, 5]),
        (5, [5, 7, 15, 16, 100], [5, 15, 100]),
    ],
)
def test_keep_every_steps(k: int, steps: list[int], kept: list[int]) -> None:
    assert sorted(KeepEverySteps(k).keep(ckpts(steps), now=0.0)) == kept


@pytest.mark.parametrize(
    ("s", "steps", "times", "kept"),
    [
        (180, [0, 1, 2, 3, 4], [0, 100, 179, 180, 400], [0, 3, 4]),
        (60, [10, 20, 30], [1000, 1059.9, 1060], [10, 30]),
        (60, [5], [7], [5]),
        (1, [], [], []),
    ],
)
def test_keep_every_seconds(
    s: float, steps: list[int], times: list[float], kept: list[int]
) -> None:
    assert sorted(KeepEverySeconds(s).keep(ckpts(steps, times), now=1e9)) == kept


def test_keep_every_seconds_is_stable_as_steps_are_added_and_evicted() -> None:
    policy = KeepEverySeconds(100)
    times = [0, 30, 60, 90, 120, 150, 180, 210, 240]
    full = set(policy.keep(ckpts(list(range(9)), [float(t) for t in times]), now=0))
    for n in range(1, 9):  # what is kept of a prefix stays kept once more steps arrive
        part = set(policy.keep(ckpts(list(range(n)), [float(t) for t in times[:n]]), now=0))
        assert part & set(range(n)) <= full | {n - 1}
    survivors = ckpts(sorted(full), [float(times[s]) for s in sorted(full)])
    assert set(policy.keep(survivors, now=0)) == full  # evicting the rest changes nothing


@pytest.mark.parametrize(
    ("policy", "metrics", "kept"),
    [
        (KeepBest("loss", 2), [3.0, 1.0, 2.0, 0.5], [1, 3]),
        (KeepBest("acc", 1, "max"), [0.1, 0.9, 0.5, 0.2], [1]),
        (KeepBest("loss", 2), [1.0, 1.0, 1.0, 2.0], [1, 2]),  # ties: the newer step
        (KeepBest("loss", 2), [None, 1.0, float("nan"), None], [1]),
        (KeepBest("loss", 1, keep_without_metric=True), [None, 1.0, 2.0], [0, 1]),
        (KeepBest("loss", 0), [1.0, 2.0], []),
    ],
)
def test_keep_best(policy: Policy, metrics: list[float | None], kept: list[int]) -> None:
    name = policy.metric  # type: ignore[attr-defined]
    cs = [
        Checkpoint(i, float(i), metrics={} if m is None else {name: m})
        for i, m in enumerate(metrics)
    ]
    assert sorted(policy.keep(cs, now=0.0)) == kept


def test_milestones_steps_all_and_any_merge_reasons() -> None:
    cs = [Checkpoint(s, float(s), milestone=s in (3, 7)) for s in range(12)]
    assert sorted(KeepMilestones().keep(cs, 0)) == [3, 7]
    assert sorted(KeepSteps(frozenset({1, 11, 99})).keep(cs, 0)) == [1, 11]
    assert sorted(KeepAll().keep(cs, 0)) == list(range(12))
    kept = KeepAny((KeepLatest(3), KeepEverySteps(10), KeepMilestones())).keep(cs, 0)
    assert sorted(kept) == [0, 3, 7, 9, 10, 11]
    assert kept[10] == {"latest", "every-10-steps"}
    assert kept[7] == {"milestone"}


# -- parsing, Orbax aliases -----------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("KeepLatest(2)", KeepLatest(2)),
        ("LatestN(n=4)", KeepLatest(4)),
        ("LatestN()", KeepAll()),
        ("EveryNSteps(interval_steps=10)", KeepEverySteps(10)),
        ("EveryNSeconds(180)", KeepEverySeconds(180)),
        ("KeepMilestones", KeepMilestones()),
        ("KeepBest('loss', 3)", KeepBest("loss", 3)),
        ("BestN('acc', n=2)", KeepBest("acc", 2, "max", True)),  # Orbax: largest kept
        ("BestN(metric='loss', n=2, reverse=True)", KeepBest("loss", 2, "min", True)),
        ("CustomSteps([1, 5])", KeepSteps(frozenset({1, 5}))),
        (
            "KeepAny([KeepLatest(3), KeepEverySteps(10)])",
            KeepAny((KeepLatest(3), KeepEverySteps(10))),
        ),
        (
            "AnyPreservationPolicy(policies=[LatestN(1), Milestones()])",
            KeepAny((KeepLatest(1), KeepMilestones())),
        ),
        ("[KeepLatest(1), KeepMilestones()]", KeepAny((KeepLatest(1), KeepMilestones()))),
    ],
)
def test_parse_policy(text: str, expected: Policy) -> None:
    parsed = parse_policy(text)
    assert parsed == expected
    assert parse_policy(parsed.describe()) == parsed  # describe() round-trips


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("KeepLatest(-1)", "integer >= 0"),
        ("KeepLatest('x')", "integer"),
        ("KeepNewest(3)", "unknown policy 'KeepNewest'"),
        ("__import__('os').system('true')", "unexpected|unknown"),
        ("KeepEverySteps(0)", "integer >= 1"),
        ("KeepBest('loss', 2, 'median')", "'min' or 'max'"),
        ("KeepLatest(3", "cannot parse"),
        ("KeepAny(KeepLatest(3))", "list of policies"),
        ("KeepLatest(n=3, m=2)", "no argument 'm'"),
        ("3", "not a policy"),
    ],
)
def test_parse_policy_errors_say_what_to_write(text: str, match: str) -> None:
    with pytest.raises(PolicyError, match=match):
        parse_policy(text)


def test_config_retention_and_marks(tmp_path: Any) -> None:
    cfg = load(env={"CKPTD_RETENTION_LOCAL": "LatestN(5)", "CKPTD_LOCAL_FLOOR": "5%"})
    # Parsed once into typed values (Orbax's alias becomes ckptd's policy).
    assert cfg.retention_local.describe() == "KeepLatest(5)" and cfg.local_floor.bytes(1000) == 50
    with pytest.raises(ConfigError, match=r"'retention_remote'.*unknown policy"):
        load(env={}, flags={"retention_remote": "KeepSome(2)"})
    with pytest.raises(ConfigError, match=r"'local_low_watermark'.*percentage"):
        load(env={}, flags={"local_low_watermark": "ten percent"})
    with pytest.raises(ConfigError, match=r"'local_evict_unuploaded'.*true or false"):
        load(env={}, flags={"local_evict_unuploaded": "maybe"})
    assert load(env={"CKPTD_LOCAL_EVICT_UNUPLOADED": "true"}).local_evict_unuploaded is True
    assert SpaceMark.parse("10%").bytes(1000) == 100
    assert SpaceMark.parse("2KiB").bytes(10) == 2048
    with pytest.raises(ValueError, match="between 0% and 100%"):
        SpaceMark.parse("150%").bytes(1000)


# -- the eviction plan ------------------------------------------------------------------
def views(local: list[int], remote: list[int], pending: list[int] = (), **flags: Any) -> list:  # type: ignore[assignment]
    steps = sorted(set(local) | set(remote) | set(pending))
    return [
        StepView(
            s,
            float(s),
            local=s in local,
            remote=s in remote,
            pending=s in pending,
            milestone=s in flags.get("milestones", ()),
            pinned=s in flags.get("pinned", ()),
            busy=s in flags.get("busy", ()),
        )
        for s in steps
    ]


LOCAL2 = KeepLatest(2)
REMOTE = KeepAny((KeepLatest(3), KeepEverySteps(10)))


def test_plan_after_25_durable_saves() -> None:
    everything = list(range(25))
    plan = plan_job(views(everything, everything), LOCAL2, REMOTE, now=0)
    assert sorted(set(everything) - set(plan.evict_local)) == [23, 24]
    assert sorted(set(everything) - set(plan.evict_remote)) == [0, 10, 20, 22, 23, 24]
    assert plan.remote_reasons[20] == ["every-10-steps"]
    assert plan.remote_reasons[24] == ["latest", "newest"]
    assert plan.local_reasons[23] == ["latest"]


def test_plan_holds_local_copies_the_bucket_still_wants() -> None:
    # 0..12 local; only 0..7 are in the bucket; 8..12 wait for the drain.
    plan = plan_job(
        views(list(range(13)), list(range(8)), pending=list(range(8, 13))), LOCAL2, REMOTE, 0
    )
    assert plan.remote_wants == {10, 11, 12}  # the newest three of the future bucket + 10
    # 8 and 9 will not be wanted, but nothing newer is in the bucket yet (12 may fail).
    assert plan.supersede == []
    assert sorted(plan.evict_local) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert plan.local_reasons[8] == plan.local_reasons[10] == ["awaiting-upload"]
    # Once 12 is in the bucket, 8 and 9 are superseded and may go.
    plan = plan_job(
        views(list(range(13)), [*range(8), 12], pending=list(range(8, 12))), LOCAL2, REMOTE, 0
    )
    assert plan.supersede == [8, 9] and plan.remote_wants == {10, 11}
    assert sorted(plan.evict_local) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_plan_does_not_supersede_without_a_newer_remote_step() -> None:
    plan = plan_job(views([5, 6, 7, 8], [], pending=[5, 6, 7, 8]), LOCAL2, KeepLatest(1), 0)
    assert plan.remote_wants == {8}
    assert plan.supersede == []  # 8 may still fail; 5..7 wait
    assert plan.evict_local == []
    assert plan.local_reasons[5] == ["awaiting-upload"]


def test_plan_opt_in_evicts_unuploaded_but_never_a_milestone() -> None:
    v = views([1, 2, 3, 4], [], pending=[1, 2, 3, 4], milestones=[1])
    plan = plan_job(v, KeepLatest(1), KeepLatest(1), 0, evict_unuploaded=True)
    assert sorted(plan.evict_local) == [2, 3]
    assert plan.local_reasons[1] == ["awaiting-upload"] and 1 in plan.remote_wants


@pytest.mark.parametrize("remote_policy", [None, KeepLatest(0)])
def test_newest_survives_keep_latest_zero(remote_policy: Policy | None) -> None:
    remote = [0, 1, 2] if remote_policy else []
    plan = plan_job(views([0, 1, 2], remote), KeepLatest(0), remote_policy, 0)
    assert sorted(plan.evict_local) == [0, 1]
    assert plan.local_reasons[2] == ["newest"]
    if remote_policy:
        assert sorted(plan.evict_remote) == [0, 1] and plan.remote_reasons[2] == ["newest"]


def test_pins_busy_and_milestones() -> None:
    v = views([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], pinned=[0], busy=[1], milestones=[2])
    plan = plan_job(v, KeepLatest(1), KeepLatest(1), 0)
    assert sorted(plan.evict_local) == [2, 3]  # milestone 2 is safe in the bucket
    assert sorted(plan.evict_remote) == [3]  # the bucket keeps milestone 2
    assert plan.local_reasons[0] == ["pinned"] and plan.remote_reasons[0] == ["pinned"]
    assert plan.local_reasons[1] == ["in-use"] and plan.remote_reasons[1] == ["in-use"]
    assert plan.remote_reasons[2] == ["milestone"]


def test_without_remote_milestones_stay_local() -> None:
    plan = plan_job(views([0, 1, 2, 3], [], milestones=[1]), KeepLatest(1), None, 0)
    assert sorted(plan.evict_local) == [0, 2]
    assert plan.local_reasons[1] == ["milestone"]


def test_pressure_candidates_are_kept_copies_the_bucket_holds() -> None:
    v = views([1, 2, 3, 4], [1, 2, 4], pending=[3])
    plan = plan_job(v, KeepLatest(4), KeepAll(), 0)
    assert plan.evict_local == []
    assert plan.pressure == [1, 2]  # 3 is not in the bucket, 4 is the newest


# -- save-decision policies ------------------------------------------------------------
def ctx(step: int, now: float = 100.0, last: int | None = 4, at: float | None = 90.0,
        reached: bool = True) -> SaveContext:  # fmt: skip
    return SaveContext(step, now, last, at, lambda _stage: reached)


@pytest.mark.parametrize(
    ("policy", "context", "expected"),
    [
        (Continuous(), ctx(5, last=None, at=None, reached=False), True),  # first save
        (Continuous(), ctx(5, reached=True), True),
        (Continuous(), ctx(5, reached=False), False),  # previous not LOCAL yet
        (Continuous(min_interval_seconds=20), ctx(5, now=100, at=90), False),
        (Continuous(min_interval_seconds=20), ctx(5, now=111, at=90), True),
        (Continuous(min_interval_seconds=20), ctx(5, now=111, at=90, reached=False), False),
        (FixedInterval(10), ctx(20), True),
        (FixedInterval(10), ctx(21), False),
        (SpecificSteps([3, 7]), ctx(7), True),
        (SpecificSteps([3, 7]), ctx(8), False),
        (AnyOf([FixedInterval(10), SpecificSteps([7])]), ctx(7), True),
        (AnyOf([FixedInterval(10), SpecificSteps([7])]), ctx(9), False),
    ],
)
def test_save_policies(policy: Any, context: SaveContext, expected: bool) -> None:
    assert policy.should_save(context) is expected


def test_continuous_asks_for_the_configured_stage() -> None:
    asked: list[str] = []
    c = SaveContext(5, 0.0, 4, 0.0, lambda stage: asked.append(stage) or True)
    assert Continuous(stage="durable").should_save(c)
    assert asked == ["durable"]
    with pytest.raises(ValueError, match="stage"):
        Continuous(stage="remote")
    with pytest.raises(ValueError, match="positive"):
        FixedInterval(0)
