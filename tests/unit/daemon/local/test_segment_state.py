"""Who holds a shared-memory segment (local/segment_state.py): the transition table,
the fields that go with each state, and a segment's life through a real staging
pool and memory tier (in a temp directory, in-process)."""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path

import pytest

from ckptd.daemon.local.lease import Segment, Want
from ckptd.daemon.local.room import Room
from ckptd.daemon.local.segment_state import (
    HAS_KEPT,
    HAS_LEASE,
    LENT,
    TRANSITIONS,
    IllegalMove,
    SegState,
    move,
)
from ckptd.daemon.local.staging import Staging

from .test_memory import UID, Node

MiB = 2**20


def segment_in(state: SegState) -> Segment:
    seg = Segment("s", 1, mapping=None)  # type: ignore[arg-type]  # never mapped here
    seg.state = state
    seg.lease_id = "lease" if state in HAS_LEASE else None
    seg.kept = ("job", 1, 0) if state in HAS_KEPT else None
    return seg


@pytest.mark.parametrize("came", list(SegState))
def test_every_listed_move_is_made_and_every_other_raises(came: SegState) -> None:
    for to in SegState:
        seg = segment_in(came)
        if to not in TRANSITIONS[came]:
            with pytest.raises(IllegalMove, match=f"{came.value} -> {to.value} is no move"):
                move(seg, to, "test", lease_id="new", kept=("job", 2, 0))
            assert seg.state is came  # an illegal move changes nothing
            continue
        move(seg, to, "test", lease_id="new", kept=("job", 2, 0))
        assert seg.state is to
        assert (seg.lease_id is not None) == (to in HAS_LEASE)
        assert (seg.kept is not None) == (to in HAS_KEPT)
        assert seg.lent == (to in LENT)


def test_every_state_is_reachable_and_gone_is_the_end() -> None:
    reached = {SegState.NEW}
    frontier = [SegState.NEW]
    while frontier:
        for to in TRANSITIONS[frontier.pop()] - reached:
            reached.add(to)
            frontier.append(to)
    assert reached == set(SegState)
    assert TRANSITIONS[SegState.GONE] == frozenset()
    assert all(SegState.GONE in TRANSITIONS[s] for s in SegState if s is not SegState.GONE)


def test_a_state_with_a_lease_or_a_key_refuses_a_move_without_one() -> None:
    with pytest.raises(IllegalMove, match="needs its lease or key"):
        move(segment_in(SegState.COMMITTING), SegState.KEPT, "no key")
    with pytest.raises(IllegalMove, match="needs its lease or key"):
        move(segment_in(SegState.FREE), SegState.SAVE, "no lease")
    seg = segment_in(SegState.SAVE)
    move(seg, SegState.COMMITTING, "the lease it has")
    assert seg.lease_id == "lease"


def test_a_segment_goes_through_staging_and_the_memory_tier(tmp_path: Path) -> None:
    """Saved, handed off, kept, shared with a restore, given back, shared again, let
    go while shared, and free for a save once nobody maps it; a save lease that was
    never handed off cannot be kept."""

    async def body() -> None:
        n = Node(tmp_path, steps=1)
        lease = await n.staging.acquire("a", 4 * MiB)
        seg = lease.segment
        assert seg.state is SegState.SAVE and seg.lease_id == lease.lease_id
        with pytest.raises(IllegalMove, match="save -> kept is no move"):
            n.staging.keep(lease, ("a", 1, 0))
        n.staging.release(lease.lease_id)
        assert seg.state is SegState.FREE and seg.lease_id is None

        await n.save("a", 1, 7)  # acquire, hand off, keep
        n.tier.writer_gone((UID, 1))  # its writer is gone: the copy may be lent
        assert seg.state is SegState.KEPT and seg.kept == ("a", 1, 0)
        handed = await n.tier.bring("a", 1, Want(0, True, UID, copy_on_write=True))
        assert handed is not None and handed.lease.segment is seg
        assert seg.state is SegState.KEPT_SHARED and seg.lent
        n.staging.release(handed.lease.lease_id)  # the client gave it back unmapped
        assert seg.state is SegState.KEPT_LENT  # lent once: never a save's again
        handed = await n.tier.bring("a", 1, Want(0, True, UID, copy_on_write=True))
        assert handed is not None and seg.state is SegState.KEPT_SHARED
        n.staging.let_go(seg)  # the tier lets go while the lease is out
        assert seg.state is SegState.SHARED and seg.kept is None
        n.staging.release(handed.lease.lease_id)  # nobody maps it: back to the pool
        assert seg.state is SegState.FREE and seg in n.staging.free_segments()
        with pytest.raises(IllegalMove, match="free, not kept: not let go"):
            n.staging.let_go(seg)  # twice: it could free a segment a new lease holds
        assert seg.state is SegState.FREE

    asyncio.run(body())


def test_a_lent_segment_a_trainer_maps_leaves_the_pool(tmp_path: Path) -> None:
    async def body() -> None:
        n = Node(tmp_path, steps=1)
        await n.save("a", 1, 7)
        n.tier.writer_gone((UID, 1))
        seg = n.tier._kept[("a", 1, 0)].segment
        handed = await n.tier.bring("a", 1, Want(0, True, UID, copy_on_write=True))
        assert handed is not None
        n.staging.lend(handed.lease.lease_id)  # the client mapped it
        assert seg.state is SegState.KEPT_LENT
        fd = os.open(n.staging.path_of(seg), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # as the restoring client holds it
            n.staging.let_go(seg)
            assert seg.state is SegState.GONE
            assert seg not in n.staging.free_segments()
            assert not n.staging.path_of(seg).exists()
        finally:
            os.close(fd)

    asyncio.run(body())


def test_a_restore_lease_the_client_maps_becomes_its_memory(tmp_path: Path) -> None:
    async def body() -> None:
        staging = Staging("ckptd-test-", 16 * MiB, 600.0, shm_dir=tmp_path, room=Room())
        staging.open()
        lease = await staging.acquire("a", MiB, restore=True)
        assert lease.segment.state is SegState.RESTORE
        with pytest.raises(IllegalMove, match="restore -> committing is no move"):
            staging.begin_commit(lease.lease_id)
        staging.lend(lease.lease_id)
        assert lease.segment.state is SegState.GONE

    asyncio.run(body())
