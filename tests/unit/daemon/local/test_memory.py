"""The memory tier's rules alone (local/memory.py), on a real staging pool (in a temp
directory) and a real catalog: which copy a save takes first, when a copy is checked,
and which leftovers a restarted daemon takes back."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.core import checksum
from ckptd.core.errors import NotFound, ResourceExhausted
from ckptd.core.manifest import Manifest, RankRecord
from ckptd.daemon.catalog import Catalog
from ckptd.daemon.local import memory as memory_module
from ckptd.daemon.local.lease import Want
from ckptd.daemon.local.memory import Image, MemoryTier
from ckptd.daemon.local.room import Room
from ckptd.daemon.local.staging import KEPT_SUFFIX, Staging

from ....helpers import own_tmpfs

MiB = 2**20
UID = os.getuid()
LIVE = os.getpid()
"""A writer that lives (this process)."""
HEADER = b"h" * 64


class Node:
    """A staging pool, a catalog and the tier over them; background work is awaited
    by :meth:`settle` (the daemon's supervisor would run it)."""

    def __init__(self, tmp_path: Path, budget: int = 16 * MiB, steps: int = 1) -> None:
        # Recorded beside it: a second Node on the same path finds the same segments.
        record = tmp_path / ".shm-dir"
        room = Room()
        self.staging = Staging(
            "ckptd-test-", budget, 600.0, shm_dir=tmp_path, record=record, room=room
        )
        self.staging.open()
        self.catalog = Catalog("node-a")
        self.spawned: list[asyncio.Task[None]] = []
        self.tier = MemoryTier(self.staging, self.catalog, steps, 0, self._spawn, room)

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        self.spawned.append(asyncio.ensure_future(coro))

    async def settle(self) -> None:
        await asyncio.gather(*self.spawned)
        self.spawned.clear()

    async def save(
        self, job: str, step: int, fill: int, owner: tuple[int, int] | None = (UID, 1)
    ) -> Image:
        """A committed one-rank step of 4 MiB whose lease the tier is offered."""
        data = bytes([fill]) * (4 * MiB)
        lease = await self.staging.acquire(job, len(data), owner=owner)
        lease.segment.view(0, len(data))[:] = data
        file_crc = checksum.value(HEADER + data)
        st = self.catalog.begin(job, step)
        record = RankRecord(0, "rank-00000.safetensors", len(HEADER) + len(data), file_crc, None)
        self.catalog.committed(
            st,
            Manifest(
                job=job,
                step=step,
                node="node-a",
                world_size=1,
                created_unix=1.0,
                ranks=[record],
                timeline=st.timeline,
                forks=st.forks,
            ),
        )
        image = Image(
            job, step, 0, st.timeline, len(HEADER), checksum.value(HEADER), len(data), file_crc
        )
        layout = (image.header_len, image.header_crc, image.data_len)
        self.staging.begin_commit(lease.lease_id)  # handed off, as the save path does
        if not self.tier.keep(st, 0, lease, layout, image.file_crc):
            self.staging.release(lease.lease_id)
        return image

    def kept(self) -> list[tuple[str, int]]:
        return sorted((j, s) for (j, s, _) in self.tier._kept)

    def flip(self, job: str, step: int) -> None:
        seg = self.tier._kept[(job, step, 0)].segment
        view = seg.view(0, 8)
        view[3] ^= 0x40

    async def bring(self, job: str, step: int) -> None:
        """A restore from the tier; its lease is given back at once."""
        handed = await self.tier.bring(job, step, Want(0, True, UID, copy_on_write=True))
        assert handed is not None
        self.staging.release(handed.lease.lease_id)


def run(body: Any) -> None:
    asyncio.run(body())


def test_a_save_takes_an_older_step_first_then_the_least_recently_kept(tmp_path: Path) -> None:
    async def body() -> None:
        n = Node(tmp_path, budget=16 * MiB, steps=2)
        await n.save("b", 1, 3)
        await n.save("a", 1, 1)
        await n.save("a", 2, 2)
        held = [await n.staging.acquire("c", 4 * MiB, owner=(UID, 2))]  # room left
        assert len(n.kept()) == 3 and n.tier.evicted == 0
        held.append(await n.staging.acquire("c", 4 * MiB, owner=(UID, 2)))  # full
        assert n.kept() == [("a", 2), ("b", 1)]  # a/1: older than its job's newest
        held.append(await n.staging.acquire("c", 4 * MiB, owner=(UID, 2)))
        assert n.kept() == [("a", 2)]  # newest steps both: the one kept first went
        assert n.tier.evicted == 2 and n.tier.kept_bytes == 4 * MiB
        assert n.staging.allocated_bytes <= n.staging.budget_bytes
        for lease in held:
            n.staging.release(lease.lease_id)

    run(body)


def test_a_save_never_waits_while_the_tier_holds_memory(tmp_path: Path) -> None:
    async def body() -> None:
        n = Node(tmp_path, budget=8 * MiB, steps=10)
        for step in range(1, 6):  # each save finds the whole budget kept
            await n.save("a", step, step)
            assert n.tier.kept_bytes <= 8 * MiB
        assert n.kept() == [("a", 4), ("a", 5)]

    run(body)


@pytest.fixture
def writer() -> Iterator[subprocess.Popen[bytes]]:
    """A process that lives until the test ends it (a trainer that saved)."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_copy_is_never_lent_while_its_writer_may_write_it(
    tmp_path: Path, writer: subprocess.Popen[bytes]
) -> None:
    async def body() -> None:
        n = Node(tmp_path, steps=2)
        await n.save("a", 1, 7, owner=(UID, writer.pid))
        await n.save("b", 1, 8, owner=None)  # a replayed handoff: writer unknown
        for job in ("a", "b"):  # a copy-on-write mapping would follow its writes
            with pytest.raises(NotFound, match="may still write it"):
                await n.bring(job, 1)
        own = Want(0, True, UID, copy_on_write=True, process=(UID, writer.pid))
        handed = await n.tier.bring("a", 1, own)  # the writer itself: its own doing
        assert handed is not None
        n.staging.release(handed.lease.lease_id)
        n.flip("a", 1)  # the live writer writes into it: nothing was lent
        writer.kill()
        writer.wait()  # gone, though no session's end said so yet
        with pytest.raises(NotFound, match="failed its checksum"):
            await n.bring("a", 1)  # checked now that nobody can write it: let go
        assert n.kept() == [("b", 1)] and n.tier.evicted == 1

    run(body)


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every crc check of a kept copy, as ``(job, step)``, in order."""
    seen: list[tuple[str, int]] = []
    real = memory_module._intact

    def counted(k: Any) -> bool:
        seen.append((k.image.job, k.image.step))
        return real(k)

    monkeypatch.setattr(memory_module, "_intact", counted)
    return seen


def test_a_copy_is_checked_once_after_its_writer_is_gone(
    tmp_path: Path, checks: list[tuple[str, int]]
) -> None:

    async def body() -> None:
        n = Node(tmp_path)
        await n.save("a", 1, 7, owner=(UID, LIVE))
        n.tier.writer_gone((UID, LIVE))
        await n.settle()
        assert checks == [("a", 1)]  # in the background, before any restore
        for _ in range(3):
            await n.bring("a", 1)
        assert checks == [("a", 1)]  # and never again

    run(body)


def test_a_writer_gone_before_its_step_was_kept_is_checked_at_once(
    tmp_path: Path, checks: list[tuple[str, int]]
) -> None:
    """The common crash: the trainer dies after its save was acknowledged, before
    LOCAL; no session end will say so later."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # exited and reaped: its pid names no process

    async def body() -> None:
        n = Node(tmp_path)
        await n.save("a", 1, 7, owner=(UID, dead.pid))
        await n.settle()
        assert checks == [("a", 1)]  # at once, in the background
        await n.bring("a", 1)
        assert checks == [("a", 1)]  # and never again

    run(body)


def test_a_copy_of_another_timeline_is_never_served(tmp_path: Path) -> None:
    async def body() -> None:
        n = Node(tmp_path, steps=3)
        await n.save("a", 5, 5)
        await n.save("a", 6, 6)
        n.catalog.begin("a", 5)  # a rollback saves step 5 again: a new timeline
        assert n.kept() == [("a", 6)]  # the old step 5 went with its step
        with pytest.raises(NotFound):
            await n.bring("a", 5)

    run(body)


def test_a_restarted_daemon_takes_back_only_records_that_match_the_catalog(
    tmp_path: Path, writer: subprocess.Popen[bytes]
) -> None:
    async def body() -> None:
        n = Node(tmp_path, steps=3)
        good = await n.save("a", 1, 1, owner=(UID, writer.pid))
        other = await n.save("a", 2, 2, owner=None)
        bad = await n.save("b", 1, 3, owner=None)
        records = sorted(n.staging.dir.glob("*" + KEPT_SUFFIX))
        assert len(records) == 3
        # What the records say, rewritten: b's crc32c is another file's.
        for r in records:
            fields = json.loads(r.read_text())
            if fields["job"] == "b":
                r.write_text(json.dumps({**fields, "file_crc": fields["file_crc"] ^ 1}))
        # A new daemon on the same segments: step 2 is gone from its catalog.
        m = Node(tmp_path, steps=3)
        for image in (good, bad):
            st = m.catalog.begin(image.job, image.step)
            rec = RankRecord(
                0, "rank-00000.safetensors", image.header_len + image.data_len, image.file_crc, None
            )
            m.catalog.committed(
                st, Manifest(image.job, image.step, "node-a", 1, 1.0, [rec], timeline=0)
            )
        del other
        writer.kill()
        writer.wait()  # its record names a writer that is gone: lent once checked
        assert m.tier.adopt_leftovers() == 1
        assert m.kept() == [("a", 1)]
        await m.bring("a", 1)
        assert m.staging.remove_leftovers() >= 4  # b's and step 2's segments and records

    run(body)


def test_a_restarted_daemon_keeps_no_more_than_its_own_limits(tmp_path: Path) -> None:
    async def body() -> None:
        n = Node(tmp_path, steps=3)
        images = [await n.save("a", step, step, owner=None) for step in (1, 2, 3)]
        # The new daemon keeps one step per job: the newest is taken back, no more.
        m = Node(tmp_path, steps=1)
        for image in images:
            st = m.catalog.begin(image.job, image.step)
            rec = RankRecord(
                0, "rank-00000.safetensors", image.header_len + image.data_len, image.file_crc, None
            )
            m.catalog.committed(
                st, Manifest(image.job, image.step, "node-a", 1, 1.0, [rec], timeline=0)
            )
        m.tier.adopt_leftovers()
        assert m.kept() == [("a", 3)]
        assert m.tier.kept_bytes <= m.tier.budget_bytes

    run(body)


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A 10 MiB tmpfs: a shared-memory filesystem smaller than the staging budget."""
    with own_tmpfs(tmp_path / "shm", "10m", mode="1777") as mnt:
        yield mnt


def test_a_full_shm_filesystem_takes_the_tiers_memory_first(small_shm: Path) -> None:
    async def body() -> None:
        n = Node(small_shm, budget=64 * MiB, steps=10)  # the budget would allow 16
        await n.save("a", 1, 1)
        await n.save("a", 2, 2)  # 8 of the 10 MiB kept
        b = await n.staging.acquire("b", 4 * MiB, owner=(UID, 2))
        assert n.kept() == [("a", 2)] and n.tier.evicted == 1  # the older step went
        c = await n.staging.acquire("c", 4 * MiB, owner=(UID, 2))
        assert n.kept() == [] and n.tier.evicted == 2
        # Nothing left to let go: the filesystem's own limit is the answer.
        with pytest.raises(ResourceExhausted, match="cannot allocate"):
            await n.staging.acquire("d", 4 * MiB, owner=(UID, 2))
        for lease in (b, c):
            n.staging.release(lease.lease_id)

    run(body)


def test_a_restarted_daemon_takes_back_no_more_than_its_staging_budget(tmp_path: Path) -> None:
    async def body() -> None:
        n = Node(tmp_path, budget=16 * MiB, steps=3)
        images = [await n.save("a", step, step, owner=None) for step in (1, 2, 3)]
        # A new daemon on the same segments, whose budget holds two of them.
        m = Node(tmp_path, budget=8 * MiB, steps=3)
        for image in images:
            st = m.catalog.begin(image.job, image.step)
            rec = RankRecord(
                0, "rank-00000.safetensors", image.header_len + image.data_len, image.file_crc, None
            )
            m.catalog.committed(
                st, Manifest(image.job, image.step, "node-a", 1, 1.0, [rec], timeline=0)
            )
        assert m.tier.adopt_leftovers() == 2
        assert m.kept() == [("a", 2), ("a", 3)]  # the newest
        m.staging.remove_leftovers()
        assert m.staging.allocated_bytes <= m.staging.budget_bytes
        on_disk = [p for p in m.staging.dir.iterdir() if not p.name.endswith(KEPT_SUFFIX)]
        assert sum(p.stat().st_size for p in on_disk) <= m.staging.budget_bytes

    run(body)
