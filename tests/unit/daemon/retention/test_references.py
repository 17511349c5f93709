"""Retention with references (an incremental step reads older steps' rank files):
the closure every tier keeps, as a pure function of the plan's views."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ckptd.daemon.retention.plan import StepView, plan_job
from ckptd.daemon.retention.policies import KeepAll, KeepLatest
from ckptd.daemon.retention.references import referenced


def views(
    local: Iterable[int],
    remote: Iterable[int] = (),
    holders: Mapping[int, set[int]] | None = None,
    pending: Iterable[int] = (),
    busy: Iterable[int] = (),
) -> list[StepView]:
    local, remote, pending, busy = set(local), set(remote), set(pending), set(busy)
    return [
        StepView(
            s,
            float(s),
            local=s in local,
            remote=s in remote,
            pending=s in pending,
            busy=s in busy,
            holders=frozenset((holders or {}).get(s, ())),
        )
        for s in sorted(local | remote | pending)
    ]


def test_referenced_follows_holders_of_holders() -> None:
    known = {9: {7}, 7: {4, 2}, 4: {1}, 2: set(), 1: set()}
    got = referenced([9], lambda s: known.get(s, set()))
    assert got == {7: 9, 4: 7, 2: 7, 1: 4}
    assert referenced([5], lambda s: known.get(s, set())) == {}


def test_a_kept_step_keeps_its_holders_transitively_and_says_why() -> None:
    plan = plan_job(views(range(6), holders={5: {3}, 3: {0}}), KeepLatest(1), None, 0)
    assert plan.evict_local == [1, 2, 4]
    assert plan.local_reasons[3] == ["referenced-by-step-5"]
    assert plan.local_reasons[0] == ["referenced-by-step-3"]
    assert plan.local_reasons[5] == ["latest", "newest"]


def test_a_holder_goes_as_soon_as_nothing_kept_needs_it() -> None:
    # Step 5 is a full save: step 3 (incremental) and its holder 0 are not needed.
    plan = plan_job(views(range(6), holders={3: {0}}), KeepLatest(1), None, 0)
    assert plan.evict_local == [0, 1, 2, 3, 4]


def test_a_busy_step_keeps_its_holders() -> None:
    # Step 2 is being read (or is the previous step a save references): its holder stays.
    plan = plan_job(views(range(4), holders={2: {0}}, busy=[2]), KeepLatest(1), None, 0)
    assert plan.evict_local == [1]
    assert plan.local_reasons[2] == ["in-use"]
    assert plan.local_reasons[0] == ["referenced-by-step-2"]


def test_the_bucket_keeps_what_its_kept_steps_reference() -> None:
    v = views([4], remote=range(5), holders={4: {2}, 2: {1}})
    plan = plan_job(v, KeepLatest(1), KeepLatest(1), 0)
    assert plan.evict_remote == [0, 3]
    assert plan.remote_reasons[2] == ["referenced-by-step-4"]
    assert plan.remote_reasons[1] == ["referenced-by-step-2"]


def test_a_step_waiting_to_go_up_keeps_its_holder_in_the_bucket() -> None:
    v = views([4], remote=range(4), holders={4: {1}}, pending=[4])
    plan = plan_job(v, KeepLatest(1), KeepLatest(1), 0)
    assert plan.evict_remote == [0, 2]
    assert plan.remote_reasons[1] == ["referenced-by-step-4"]


def test_a_pending_holder_is_wanted_by_the_bucket_never_superseded() -> None:
    # Step 3 is complete in the bucket; pending step 4 references pending step 2,
    # which the remote policy alone would supersede.
    v = views([2, 3, 4], remote=[3], holders={4: {2}}, pending=[2, 4])
    plan = plan_job(v, KeepLatest(1), KeepLatest(1), 0)
    assert plan.supersede == []
    assert 2 in plan.remote_wants
    assert 2 not in plan.evict_local
    assert plan.local_reasons[2] == ["referenced-by-step-4"]
    # Without the reference it is superseded, as before.
    plain = plan_job(views([2, 3, 4], remote=[3], pending=[2, 4]), KeepLatest(1), KeepLatest(1), 0)
    assert plain.supersede == [2]


def test_a_superseded_step_does_not_pull_its_holders() -> None:
    # Pending step 2 (superseded: step 3 is complete remotely) references step 1.
    v = views([1, 2, 3], remote=[3], holders={2: {1}}, pending=[1, 2])
    plan = plan_job(v, KeepLatest(1), KeepLatest(1), 0)
    assert sorted(plan.supersede) == [1, 2]
    assert plan.evict_local == [1, 2]


def test_disk_pressure_never_takes_a_referenced_copy() -> None:
    v = views(range(3), remote=range(3), holders={1: {0}})
    plan = plan_job(v, KeepAll(), KeepAll(), 0)
    assert plan.pressure == [1]  # step 0 only once step 1 is gone
    assert plan.local_reasons[0] == ["all", "referenced-by-step-1"]
