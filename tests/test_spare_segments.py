"""Spare segments (local/spares.py): a segment that leaves the staging pool's service
is replaced in the background, so a restarted trainer's saves reuse memory already
faulted in instead of paying for fresh memory in their blocking time.

Whether a lease got a new segment is read from the daemon's counter
``staging_segments_created``; every wait is on a status field, a failpoint or the
spares' own settling, never a sleep.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.daemon import faults
from ckptd.daemon.local.lease import Want
from ckptd.daemon.local.spares import FAILPOINT
from ckptd.daemon.local.staging import Stopping

from .test_memory_tier import Trainer, memory_daemon, saved_by_trainer, wait_status
from .unit.daemon.local.test_memory import Node

MiB = 2**20
UID = os.getuid()


# -- against a real daemon ------------------------------------------------------------
def test_a_restarted_trainers_second_save_reuses_a_segment(make_daemon: Any) -> None:
    d = memory_daemon(make_daemon)
    t = Trainer(d, "life")
    t.save(1, seed=1)
    t.save(2, seed=2)  # the pool holds two segments: step 2's (kept) and one free
    t.kill()
    st = wait_status(d, lambda s: s.memory_tier_files == 1)
    created, spares = st.staging_segments_created, st.staging_spares_made
    t = Trainer(d, "life")  # the next life maps step 2's segment copy-on-write
    assert t.do("restore") == "RESTORED 2"
    t.save(3, seed=3)  # takes the free segment; the tier keeps it
    # The restored segment is the trainer's, step 3's is kept: one more segment is
    # made in the background, as the trainer's next steps run (a spare, or the
    # client's reservation of its second save's segment: client/ahead.py).
    made = created + spares + 1
    wait_status(d, lambda s: s.staging_segments_created + s.staging_spares_made == made)
    before = d.status().staging_segments_created
    t.save(4, seed=4)
    st = d.status()
    assert st.staging_segments_created == before  # granted that one: no fresh memory
    assert st.staging_allocated_bytes <= st.staging_budget_bytes
    t.save(5, seed=5)  # steady state: the tier gives step 3's segment back, none made
    st = d.status()
    assert st.staging_segments_created + st.staging_spares_made == made
    assert t.do("check 2") == "SAME"  # the restored arrays never changed


def test_no_spare_when_nothing_left_the_pool(make_daemon: Any) -> None:
    d = memory_daemon(make_daemon, "--memory-tier-steps", "0")
    saved_by_trainer(d, "plain", 1, seed=1)
    saved_by_trainer(d, "plain", 2, seed=2)
    st = d.status()
    assert (st.staging_segments_created, st.staging_spares_made) == (1, 0)


# -- the pool's rules alone -----------------------------------------------------------
def run(body: Any) -> None:
    asyncio.run(body())


async def lend_newest(n: Node, job: str, step: int) -> int:
    """A trainer restores ``step`` from the tier copy-on-write and keeps it: it holds
    the segment's flock (as a client mapping it does) on the descriptor returned. The
    trainer that saved it is gone (Node.save's writer): a live one's is never lent."""
    n.tier.writer_gone((UID, 1))
    handed = await n.tier.bring(job, step, Want(0, True, UID, copy_on_write=True))
    assert handed is not None
    fd = os.open(n.staging.path_of(handed.lease.segment), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    n.staging.lend(handed.lease.lease_id)
    return fd


def test_a_lent_segment_is_replaced_by_a_spare_the_next_save_takes(tmp_path: Path) -> None:
    async def body() -> None:
        n = Node(tmp_path, budget=16 * MiB)
        await n.save("a", 1, 1)
        await n.staging.spares.settle()
        assert n.staging.spares.made == 1  # the first kept segment left no free one
        await n.save("a", 2, 2)  # took the spare; step 1's segment is free again
        await n.staging.spares.settle()
        assert (n.staging.segments_created, n.staging.spares.made) == (1, 1)
        trainer = await lend_newest(n, "a", 2)
        await n.staging.spares.settle()
        assert n.staging.spares.made == 1  # a free segment is left: no spare
        await n.save("a", 3, 3)  # the free one; step 2's leaves the pool (the trainer's)
        await n.staging.spares.settle()
        assert n.staging.spares.made == 2
        await n.save("a", 4, 4)
        assert n.staging.segments_created == 1
        assert n.staging.allocated_bytes <= n.staging.budget_bytes
        os.close(trainer)

    run(body)


def test_a_tight_budget_makes_no_spare(tmp_path: Path) -> None:
    async def body() -> None:
        n = Node(tmp_path, budget=8 * MiB)  # one kept segment and one save's
        await n.save("a", 1, 1)
        trainer = await lend_newest(n, "a", 1)
        await n.staging.spares.settle()
        os.close(trainer)
        assert n.staging.spares.made == 0
        assert n.staging.allocated_bytes == 4 * MiB  # nothing made
        assert sorted(p.name for p in n.staging.dir.iterdir() if ".kept" not in p.name) == [
            n.tier._kept[("a", 1, 0)].segment.name
        ]

    run(body)


@pytest.fixture
def paused_spare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The spare's worker stops at its failpoint until the test releases it."""
    where = tmp_path / "failpoints"
    where.mkdir()
    monkeypatch.setenv(faults.DIR_VARIABLE, str(where))
    monkeypatch.setitem(faults._POINTS, FAILPOINT, "pause")
    yield where
    faults.release(where, FAILPOINT)  # a test that failed holding it must not hang the exit


def test_a_spare_being_made_counts_in_the_budget_and_a_save_waits_for_it(
    tmp_path: Path, paused_spare: Path
) -> None:
    async def body() -> None:
        n = Node(tmp_path, budget=12 * MiB)
        await n.save("a", 1, 1)  # made for it, kept: a spare is begun at once
        await asyncio.to_thread(faults.wait_hit, paused_spare, FAILPOINT, 60)
        assert n.staging.allocated_bytes == 8 * MiB  # the spare holds its room
        created = n.staging.segments_created
        # A save that comes meanwhile waits for it rather than make another (begun
        # earlier, it is ready sooner; two would stay one too many).
        save = asyncio.ensure_future(n.staging.acquire("b", 4 * MiB, owner=(UID, 2)))
        await asyncio.sleep(0)
        assert not save.done()
        faults.release(paused_spare, FAILPOINT)
        lease = await save
        assert (n.staging.segments_created, n.staging.spares.made) == (created, 1)
        assert n.staging.allocated_bytes == 8 * MiB
        n.staging.release(lease.lease_id)

    run(body)


def test_saves_short_of_room_take_the_spare_being_made(tmp_path: Path, paused_spare: Path) -> None:
    async def body() -> None:
        n = Node(tmp_path, budget=12 * MiB)
        await n.save("a", 1, 1)
        await asyncio.to_thread(faults.wait_hit, paused_spare, FAILPOINT, 60)
        saves = [
            asyncio.ensure_future(n.staging.acquire(j, 4 * MiB, owner=(UID, 2))) for j in "bcd"
        ]
        await asyncio.sleep(0)
        assert not saves[0].done()  # the first waits for the spare; the others do not
        faults.release(paused_spare, FAILPOINT)
        leases = await asyncio.gather(*saves)
        # The spare, one new segment, and the tier's kept one (it gave way): none
        # exceeded the budget meanwhile.
        assert n.staging.allocated_bytes <= n.staging.budget_bytes
        assert n.tier.files == 0 and n.staging.segments_created == 2
        assert n.staging.spares.made == 1
        for x in leases:
            n.staging.release(x.lease_id)
        assert len([p for p in n.staging.dir.iterdir() if ".kept" not in p.name]) == 3

    run(body)


def test_a_held_spare_maker_creates_nothing_once_stop_begins(
    tmp_path: Path, paused_spare: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        n = Node(tmp_path, budget=16 * MiB)
        await n.save("a", 1, 1)
        await asyncio.to_thread(faults.wait_hit, paused_spare, FAILPOINT, 60)
        created: list[int] = []
        make = n.staging.create_segment

        def counted(size: int) -> Any:
            created.append(size)
            return make(size)

        monkeypatch.setattr(n.staging, "create_segment", counted)
        seg_dir = n.staging.dir

        def release_once_stopping() -> None:
            while not n.staging.spares._closed:  # stop began: only then let it go on
                threading.Event().wait(0.001)
            faults.release(paused_spare, FAILPOINT)

        releaser = threading.Thread(target=release_once_stopping)
        releaser.start()
        n.tier.close()
        n.staging.close()  # waits for the worker it holds
        releaser.join()
        worker = n.staging.spares._worker
        assert worker is not None
        worker.shutdown(wait=True)
        assert created == []  # nothing made once the stop began, not even briefly
        assert not seg_dir.exists()

    run(body)


def test_once_stop_begins_no_spare_is_asked_for_and_no_segment_made(tmp_path: Path) -> None:
    async def body() -> None:
        n = Node(tmp_path, budget=16 * MiB)
        lease = await n.staging.acquire("a", 4 * MiB, owner=(UID, 1))
        n.staging.begin_stop()
        n.staging.begin_commit(lease.lease_id)
        n.staging.keep(lease, ("a", 1, 0))  # a save finished during the stop: kept
        await n.staging.spares.settle()
        assert n.staging.spares.made == 0 and n.staging.allocated_bytes == 4 * MiB
        with pytest.raises(Stopping):
            await n.staging.acquire("b", 8 * MiB, owner=(UID, 2))
        assert n.staging.segments_created == 1

    run(body)


def test_a_segment_a_view_still_uses_is_counted_until_unmapped(tmp_path: Path) -> None:
    async def body() -> None:
        n = Node(tmp_path, budget=16 * MiB)
        lease = await n.staging.acquire("a", 4 * MiB, restore=True, owner=(UID, 1))
        mapping = lease.segment.mapping
        view = lease.segment.view(0, 4096)  # a thread still reading it, say
        n.staging.lend(lease.lease_id)  # the trainer's now: unlinked, out of the pool
        assert not (n.staging.dir / lease.segment.name).exists()
        assert n.staging.allocated_bytes == 4 * MiB  # the daemon still maps it
        del view
        n.staging.reclaim_expired()
        assert mapping.closed and n.staging.allocated_bytes == 0

    run(body)


def test_no_spare_while_the_next_save_already_holds_a_segment(tmp_path: Path) -> None:
    # The client hears LOCAL and starts its next save before the daemon's keep has
    # been considered: that save's own segment comes back into the rotation once it
    # is in, so a spare now would stay one segment too many for good.
    async def body() -> None:
        n = Node(tmp_path, budget=16 * MiB)
        following = await n.staging.acquire("a", 4 * MiB, owner=(UID, 1))
        await n.save("a", 1, 1)  # kept, no free segment left, a save in flight
        await n.staging.spares.settle()
        # The one spare, begun when the first lease's segment was made, went to step 1.
        assert n.staging.spares.made <= 1
        n.staging.release(following.lease_id)
        assert n.staging.allocated_bytes == 8 * MiB  # two segments, as before spares

    run(body)


def test_a_segment_made_for_a_save_the_tier_keeps_begins_the_next_ones_spare(
    tmp_path: Path,
) -> None:
    # The first save of a job had to make its segment, and the memory tier will keep
    # it: the next save needs another. The spare is begun at the grant, while the first
    # save is written, not once it is kept (then a save right after LOCAL made its
    # own in its blocking time, and the spare stayed one segment too many).
    async def body() -> None:
        n = Node(tmp_path, budget=16 * MiB)
        first = await n.staging.acquire("a", 4 * MiB, owner=(UID, 1))
        await n.staging.spares.settle()
        assert (n.staging.segments_created, n.staging.spares.made) == (1, 1)
        second = await n.staging.acquire("a", 4 * MiB, owner=(UID, 1))
        assert second.segment is not first.segment
        assert n.staging.segments_created == 1  # the spare: no fresh memory
        await n.staging.spares.settle()
        assert n.staging.spares.made == 1  # granted from the pool: no spare for it
        for lease in (first, second):
            n.staging.release(lease.lease_id)
        await n.save("a", 1, 1)
        await n.save("a", 2, 2)
        await n.staging.spares.settle()
        assert n.staging.allocated_bytes == 8 * MiB  # two segments, steady

    run(body)


def test_no_early_spare_without_the_memory_tier(tmp_path: Path) -> None:
    async def body() -> None:
        n = Node(tmp_path, budget=16 * MiB, steps=0)
        lease = await n.staging.acquire("a", 4 * MiB, owner=(UID, 1))
        await n.staging.spares.settle()
        assert n.staging.spares.made == 0  # the segment comes back once the save is in
        n.staging.release(lease.lease_id)

    run(body)
