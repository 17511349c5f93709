"""The step catalog alone (no daemon process): its transition table, its events, its waiters."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from typing import Any

import pytest

from ckptd.core.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound
from ckptd.core.manifest import Manifest, RankRecord
from ckptd.daemon.catalog import (
    DRAINING,
    DURABLE,
    FAILED,
    LOCAL,
    NEW,
    STAGING,
    SUPERSEDED,
    TRANSITIONS,
    Catalog,
    Event,
    IllegalTransition,
    Step,
)
from ckptd.proto import ckptd_pb2 as pb

NODE = "node-a"


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def manifest(
    job: str = "j",
    step: int = 1,
    milestone: bool = False,
    timeline: int = 0,
    forks: tuple[tuple[int, int], ...] = (),
) -> Manifest:
    return Manifest(
        job=job,
        step=step,
        node=NODE,
        world_size=1,
        created_unix=1000.0 + step,
        ranks=[RankRecord(0, "rank-00000.safetensors", 4096, 7, None)],
        shards=[],
        milestone=milestone,
        metrics={"loss": 0.5},
        timeline=timeline,
        forks=forks,
    )


def catalog() -> Catalog:
    clock = itertools.count(100.0)
    return Catalog(NODE, clock=lambda: float(next(clock)))


def kinds(c: Catalog) -> list[str]:
    return [pb.StepEvent.Name(e.kind).removeprefix("STEP_EVENT_") for e in c.events()]


def test_a_save_walks_the_table_and_emits_one_event_per_transition() -> None:
    async def body() -> None:
        c = catalog()
        seen: list[Event] = []
        c.subscribe(seen.append)
        st = c.begin("j", 1, node_ranks=(0,), world_size=1, metrics={"loss": 1.0})
        assert (st.state, st.handoff_at) == (STAGING, 100.0)
        c.committed(st, manifest())
        assert st.state == LOCAL and st.local and st.tiers() == [pb.TIER_LOCAL]
        c.draining(st)
        c.retrying(st, "retrying in 0.5 s: reset")
        assert (st.state, st.error) == (DRAINING, "retrying in 0.5 s: reset")
        c.durable(st, files_sent="1")
        assert st.state == DURABLE and st.error == "" and st.remote_nodes == {NODE}
        assert st.tiers() == [pb.TIER_LOCAL, pb.TIER_REMOTE]
        assert kinds(c) == ["STAGED", "LOCAL", "DRAINING", "RETRYING", "DURABLE"]
        assert [e.seq for e in c.events()] == [1, 2, 3, 4, 5] and c.last_seq == 5
        assert seen == c.events()  # listeners see every event, in order
        assert [e.state for e in seen] == [STAGING, LOCAL, DRAINING, DRAINING, DURABLE]
        assert dict(seen[-1].attributes) == {"files_sent": "1"}

    run(body())


def test_only_the_catalog_changes_a_step() -> None:
    async def body() -> None:
        st = catalog().begin("j", 1)
        with pytest.raises(AttributeError, match="owned by the Catalog"):
            st.state = LOCAL  # type: ignore[misc]
        with pytest.raises(AttributeError, match="owned by the Catalog"):
            st.manifest = manifest()  # type: ignore[misc]
        assert st.state == STAGING

    run(body())


def test_every_transition_outside_the_table_is_refused() -> None:
    async def body() -> None:
        c = catalog()
        states = [NEW, STAGING, LOCAL, DRAINING, DURABLE, SUPERSEDED, FAILED]
        for start, to in itertools.product(states, states):
            st = Step("j", 1, state=start)
            if to in TRANSITIONS[start]:
                c._move(st, to)
                assert st.state == to
            else:
                with pytest.raises(IllegalTransition):
                    c._move(st, to)
                assert st.state == start

    run(body())


def test_requests_out_of_order_are_bugs_not_silent_changes() -> None:
    async def body() -> None:
        c = catalog()
        st = c.begin("j", 1)
        with pytest.raises(IllegalTransition):
            c.durable(st)  # STAGING cannot become DURABLE
        with pytest.raises(IllegalTransition):
            c.draining(st)
        with pytest.raises(IllegalTransition):
            c.retrying(st, "x")
        with pytest.raises(IllegalTransition):
            c.local_removed(st, pb.STEP_EVENT_EVICTED_LOCAL, "no copy yet")
        c.committed(st, manifest())
        with pytest.raises(IllegalTransition):
            c.committed(st, manifest())
        with pytest.raises(IllegalTransition):
            c.fetched(st, manifest())  # it has a local copy already
        assert kinds(c) == ["STAGED", "LOCAL"]

    run(body())


def test_a_step_number_is_taken_until_its_save_failed() -> None:
    async def body() -> None:
        c = catalog()
        st = c.begin("j", 1)
        with pytest.raises(Conflict, match="being saved here already"):
            c.begin("j", 1)
        c.failed(st, "writing rank 0 failed: ENOSPC", "local")
        assert (st.state, st.error) == (FAILED, "writing rank 0 failed: ENOSPC")
        again = c.begin("j", 1)  # a failed save may be retried under its number
        assert again is not st and again.state == STAGING and c.require("j", 1) is again
        failed = next(e for e in c.events() if e.kind == pb.STEP_EVENT_FAILED)
        assert dict(failed.attributes) == {"stage": "local"}

    run(body())


def test_coalescing_and_retention_moves() -> None:
    async def body() -> None:
        c = catalog()
        old, new = c.begin("j", 1), c.begin("j", 2)
        c.committed(old, manifest(step=1))
        c.committed(new, manifest(step=2))
        c.draining(old)
        c.requeued(old, "a newer step goes first (coalescing)")
        assert old.state == LOCAL
        c.draining(new)
        c.durable(new)
        c.superseded(old, "superseded by step 2")
        assert (old.state, old.error) == (SUPERSEDED, "superseded by step 2")
        # Retention removes step 2 from the bucket: its local copy stays, SUPERSEDED.
        c.remote_removed(new, "removed from the remote tier by its retention policy")
        assert new.state == SUPERSEDED and not new.in_remote and new.local
        # Evicting the last copy of a step removes it from the catalog.
        c.local_removed(old, pb.STEP_EVENT_EVICTED_LOCAL, "retention")
        assert c.get("j", 1) is None
        assert c.events()[-1].state == NEW and c.events()[-1].tiers == ()

    run(body())


def test_bucket_discoveries_fetches_and_set_asides() -> None:
    async def body() -> None:
        c = catalog()
        st = c.discovered(
            "j",
            5,
            {NODE, "node-b"},
            False,
            pinned=True,
            created_unix=7.0,
            milestone=True,
            metrics={"loss": 0.1},
        )
        assert (st.state, st.local, st.pinned, st.time) == (DURABLE, False, True, 7.0)
        assert st.tiers() == [pb.TIER_REMOTE] and st.milestone
        again = c.discovered("j", 5, {NODE}, False)
        assert again is st and len(c.events()) == 1  # nothing new: no event
        c.fetched(st, manifest(step=5), node=NODE, via="shared memory")
        assert st.local and st.tiers() == [pb.TIER_LOCAL, pb.TIER_REMOTE]
        assert c.events()[-1].attributes["via"] == "shared memory"
        c.peers_fetched(st, "node-b")
        assert st.peers == {"node-b"}
        c.local_removed(st, pb.STEP_EVENT_SET_ASIDE, "rank-00000.safetensors:x")
        assert c.get("j", 5) is st and not st.local and st.peers == frozenset()
        # A LOCAL step whose own marker turns up in the bucket is DURABLE.
        local = c.begin("j", 6)
        c.committed(local, manifest(step=6))
        c.discovered("j", 6, {NODE}, False)
        assert local.state == DURABLE
        assert kinds(c)[-1] == "DISCOVERED"

    run(body())


def test_pins_need_a_complete_copy() -> None:
    async def body() -> None:
        c = catalog()
        st = c.begin("j", 1)
        with pytest.raises(FailedPrecondition, match="no complete copy to pin"):
            c.set_pinned(st, True)
        c.committed(st, manifest())
        c.set_pinned(st, True)
        c.set_pinned(st, False)
        assert kinds(c)[-2:] == ["PINNED", "UNPINNED"] and not st.pinned
        # A step with no copy left (its save failed) is not there to pin: NotFound, as
        # for a step retention removed, not "try again later".
        gone = c.begin("j", 2)
        c.failed(gone, "the trainer died", "local")
        with pytest.raises(NotFound, match="no copy left to pin"):
            c.set_pinned(gone, True)

    run(body())


def test_adoption_that_never_committed_is_forgotten() -> None:
    async def body() -> None:
        c = catalog()
        st = c.begin("j", 3, adopted=True)
        c.abandoned(st, "adopting /x failed: gone")
        assert c.get("j", 3) is None
        assert kinds(c) == ["STAGED", "ABANDONED"]

    run(body())


def test_waiters_wake_on_transitions_failures_timeouts_and_stop() -> None:
    async def body() -> None:
        c = catalog()
        st = c.begin("j", 1)
        waiter = asyncio.create_task(c.wait("j", 1, LOCAL, 30))
        await asyncio.sleep(0)
        assert not waiter.done()
        c.committed(st, manifest())
        assert (await waiter) is st
        durable = asyncio.create_task(c.wait("j", 1, DURABLE, 30))
        await asyncio.sleep(0)
        c.draining(st)
        c.failed(st, "upload failed: AccessDenied", "remote")
        await asyncio.sleep(0)
        # Not final: the local copy stays and the drain tries the upload again later.
        assert not durable.done() and not st.final(DURABLE)
        durable.cancel()
        assert (await c.wait("j", 1, LOCAL, 0)).reached(LOCAL)  # already there
        other = c.begin("j", 2)
        assert (await c.wait("j", 2, LOCAL, 0.01)) is other  # timed out: as it is
        stopping = asyncio.create_task(c.wait("j", 2, LOCAL, 30))
        await asyncio.sleep(0)
        c.stopping.set()
        assert (await stopping).state == STAGING
        with pytest.raises(InvalidArgument, match="wait for LOCAL or DURABLE"):
            await c.wait("j", 2, SUPERSEDED, 1)
        with pytest.raises(NotFound, match="no save of step 9"):
            await c.wait("j", 9, LOCAL, 1)

    run(body())


def test_event_history_filters_and_long_polls() -> None:
    async def body() -> None:
        c = catalog()
        c.begin("a", 1)
        c.begin("b", 1)
        assert [e.job for e in c.events(job="b")] == ["b"]
        assert c.events(after=1) == c.events()[1:]
        assert len(c.events(limit=1)) == 1
        poll = asyncio.create_task(c.wait_for_event(c.last_seq, "a", 30))
        await asyncio.sleep(0)
        c.begin("b", 2)  # another job: the poll waits on
        await asyncio.sleep(0)
        assert not poll.done()
        c.begin("a", 2)
        await asyncio.wait_for(poll, 5)
        await c.wait_for_event(c.last_seq, "", 0.01)  # nothing new: returns at the timeout

    run(body())


def test_a_failing_listener_does_not_break_transitions() -> None:
    async def body() -> None:
        c = catalog()

        def broken(event: Event) -> None:
            raise RuntimeError("listener bug")

        c.subscribe(broken)
        st = c.begin("j", 1)
        c.committed(st, manifest())
        assert st.state == LOCAL and kinds(c) == ["STAGED", "LOCAL"]

    run(body())


def test_a_copy_set_aside_while_it_uploads_leaves_the_step_to_the_drain() -> None:
    async def body() -> None:
        c = catalog()
        st = c.begin("j", 1)
        c.committed(st, manifest())
        c.draining(st)
        c.local_removed(st, pb.STEP_EVENT_SET_ASIDE, "rank-00000.safetensors:x")
        assert c.get("j", 1) is st and st.state == DRAINING and not st.local
        c.failed(st, "its local copy failed a checksum and was set aside", "remote")
        assert st.state == FAILED and st.final(DURABLE)

    run(body())


def test_the_end_of_the_last_read_of_a_copy_is_told() -> None:
    """The drain passes over a LOCAL step that is being read (its peer replication, a
    restore); it hears when the last read ends, so the upload does not wait a period."""

    async def body() -> None:
        c = catalog()
        freed: list[tuple[str, int]] = []
        c.on_free(lambda st: freed.append(st.key))
        st = c.begin("j", 1, node_ranks=(0,), world_size=1)
        c.committed(st, manifest())
        with c.in_use(st):
            with c.in_use(st):
                pass
            assert freed == [] and st.busy  # another read still runs
        assert freed == [("j", 1)] and not st.busy

    run(body())


def test_older_steps_stop_claiming_a_peer_before_a_newer_replica_goes_there() -> None:
    """The peer drops the job's older replica when it takes the new one, before it
    answers: an answer lost with the peer must not leave the older step claiming it."""

    async def body() -> None:
        c = catalog()
        old, new = (c.begin("j", n, node_ranks=(0,), world_size=1) for n in (1, 2))
        c.committed(old, manifest(step=1))
        c.committed(new, manifest(step=2))
        c.replicated(old, frozenset({"peer-a", "peer-b"}))
        assert pb.TIER_PEER in old.tiers()
        c.replicating(new, frozenset({"peer-a"}))  # sent; the answer never comes
        assert old.replica_nodes == {"peer-b"} and not new.replica_nodes
        c.replicated(new, frozenset({"peer-b"}))
        assert not old.replica_nodes and new.replica_nodes == {"peer-b"}

    run(body())


def test_a_bucket_copy_of_a_replaced_save_never_comes_back_as_the_step() -> None:
    """A later timeline began with a save under this number: an older timeline's copy of
    that number in the bucket is the replaced save, not a step, once nothing is known
    under the number here (the replacing save left before its upload retracted it).
    Above the fork, an older timeline's copy is only abandoned, and stays a step."""
    c = catalog()
    forks = ((1, 0), (2, 0))
    got = c.discovered("j", 3, {NODE}, False, timeline=2, forks=forks)
    assert got is not None and c.lineage("j") == forks
    assert c.discovered("j", 0, {NODE}, False, timeline=1, forks=((1, 0),)) is None
    assert c.get("j", 0) is None
    older = c.discovered("j", 1, {NODE}, False, timeline=1, forks=((1, 0),))
    assert older is not None and older.abandoned  # left behind above the fork, kept
    live = c.discovered("j", 0, {NODE}, False, timeline=2, forks=forks)
    assert live is not None and not live.abandoned  # the replacing save's own copy


def test_a_replaced_saves_copy_read_before_the_fork_is_dropped_once_it_is_known() -> None:
    """A node's index is read oldest step first: the replaced save's copy of step 0 comes
    before the step that carries the fork replacing it; it leaves once that one does."""
    c = catalog()
    old = c.discovered("j", 0, {NODE}, False, timeline=1, forks=((1, 0),))
    assert old is not None and c.get("j", 0) is old
    c.discovered("j", 1, {NODE}, False, timeline=2, forks=((1, 0), (2, 0)))
    assert c.get("j", 0) is None and [s.step for s in c.list("j")] == [1]


def test_a_number_a_later_save_took_is_kept_until_its_older_bucket_copy_is_retracted() -> None:
    """Run B (timeline 1, begun at step 0) saves step 2 again, over run A's uploaded
    step 2: the number stays recorded as taken until the evictor retracts A's copy, even
    once B's step 2 left without going up, and A's copy never comes back as the step."""
    c = catalog()
    a = c.discovered("j", 2, {NODE}, False, timeline=0)
    assert a is not None and c.replaced_numbers("j") == {}
    b = c.begin("j", 2, node_ranks=(0,), world_size=1, timeline=(1, ((1, 0),)))
    assert c.replaced_numbers("j") == {2: 1}
    c.committed(b, manifest(step=2, timeline=1, forks=((1, 0),)))
    c.superseded(b, "a newer step went up first")
    c.local_removed(b, pb.STEP_EVENT_EVICTED_LOCAL, "retention")
    assert c.get("j", 2) is None
    assert c.discovered("j", 2, {NODE}, False, timeline=0) is None  # A's: replaced
    c.retracted("j", 2, 0)  # not the timeline recorded: stays
    assert c.replaced_numbers("j") == {2: 1}
    c.retracted("j", 2, 1)
    assert c.replaced_numbers("j") == {}


def test_a_step_known_here_records_an_older_bucket_copy_under_its_number() -> None:
    """After a restart the replacing save is local (its record of the replacement died
    with the daemon); the older copy read from the bucket under its number is recorded,
    so it is retracted even if the local step never goes up."""
    c = catalog()
    st = c.recovered(manifest(step=2, timeline=1, forks=((1, 0),)), False)
    assert c.discovered("j", 2, {NODE}, False, timeline=0) is None
    assert c.get("j", 2) is st and c.replaced_numbers("j") == {2: 1}


def test_a_local_copy_this_nodes_bucket_copy_outdates_gives_way_to_it() -> None:
    """After a node loss the peer gave back step 0 of timeline 0, but this node's own
    copy in the bucket is of timeline 1 (a rerun saved step 0 again; the peer was down):
    the local copy is a replaced save. The step becomes the bucket's, and the local
    copy waits to leave view before a fetch commits in its place. Another node's copy,
    a pinned step or one being saved keeps the local step."""
    c = catalog()
    old = c.peer_fetched(manifest(step=0), "peer-b")
    assert c.discovered("j", 0, {"node-b"}, False, timeline=1, forks=((1, 0),)) is None
    assert c.get("j", 0) is old  # another node's copy: not this node's history
    new = c.discovered("j", 0, {NODE}, False, timeline=1, forks=((1, 0),))
    assert new is not None and new is not old and new.timeline == 1
    assert not new.local and not new.abandoned and c.replacing(new) is old
    assert pb.StepEvent.Name(c.events()[-2].kind) == "STEP_EVENT_REPLACED"
    pinned = c.peer_fetched(manifest(step=5), "peer-b")
    c.set_pinned(pinned, True)
    assert c.discovered("j", 5, {NODE}, False, timeline=1, forks=((1, 0),)) is None
    assert c.get("j", 5) is pinned
