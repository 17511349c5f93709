"""Admission alone, with the free space injected: refusals at the floor, no bucket I/O."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from ckptd.core.errors import ResourceExhausted
from ckptd.daemon.local.admission import Admission, DiskSpace, Space, SpaceMark
from ckptd.daemon.local.staging import Staging
from ckptd.daemon.local.store import LocalStore

MiB = 2**20


class FakeDisk:
    """What the filesystem would say; a relief pass frees ``relief`` bytes."""

    def __init__(self, free: int, total: int = 1000 * MiB) -> None:
        self.free, self.total = free, total
        self.passes = 0

    def measure(self, root: Path) -> Space:
        return Space(self.free, self.total)

    async def relieve(self, relief: int) -> None:
        self.passes += 1
        self.free += relief


def admission(
    tmp_path: Path, disk: FakeDisk, floor: str = "100MiB", relief: int | None = None
) -> Admission:
    """``relief``: bytes the relief pass frees (None: admission has no relief pass)."""
    store = LocalStore(tmp_path)
    staging = Staging("ckptd-test-", 512 * MiB, 600.0, shm_dir=tmp_path)
    space = DiskSpace(tmp_path, SpaceMark.parse("50%"), SpaceMark.parse(floor), disk.measure)

    async def run_io(fn: object, *args: object) -> object:
        return fn(*args)  # type: ignore[operator]

    relieve = None if relief is None else lambda: disk.relieve(relief)
    return Admission(space, staging, store, run_io, "KeepLatest(3)", relieve)


def test_a_save_that_fits_above_the_floor_is_admitted(tmp_path: Path) -> None:
    disk = FakeDisk(free=300 * MiB)
    adm = admission(tmp_path, disk)
    asyncio.run(adm.check_space(200 * MiB))
    assert adm.capacity_reason(200 * MiB) == "" and disk.passes == 0


def test_below_the_floor_one_local_pass_runs_then_the_save_is_refused(tmp_path: Path) -> None:
    disk = FakeDisk(free=250 * MiB)
    adm = admission(tmp_path, disk, relief=0)  # nothing the retention may evict
    with pytest.raises(ResourceExhausted, match=r"0.05 GiB short.*retention_local = 'KeepLatest"):
        asyncio.run(adm.check_space(200 * MiB))
    assert disk.passes == 1
    assert "floor is 0.10 GiB" in adm.capacity_reason(200 * MiB)


def test_a_relief_pass_that_frees_enough_admits_the_save(tmp_path: Path) -> None:
    disk = FakeDisk(free=250 * MiB)
    adm = admission(tmp_path, disk, relief=100 * MiB)
    asyncio.run(adm.check_space(200 * MiB))
    assert disk.passes == 1


def test_a_percentage_floor_follows_the_disk_size(tmp_path: Path) -> None:
    disk = FakeDisk(free=150 * MiB, total=1000 * MiB)
    adm = admission(tmp_path, disk, floor="10%")
    assert adm.disk.marks() == (500 * MiB, 100 * MiB)
    assert adm.capacity_reason(40 * MiB) == ""
    assert "local disk has" in adm.capacity_reason(60 * MiB)


class Announced:
    """A lock that sets ``entering`` when a thread is about to take it."""

    def __init__(self, lock: Any, entering: threading.Event) -> None:
        self.lock, self.entering = lock, entering

    def __enter__(self) -> None:
        self.entering.set()
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_spares_dropped_by_another_thread_are_gone_when_a_drop_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admission and the evictor drop spares from two threads at once. The one that
    finds them taken must not return while the other still deletes them: the evictor
    measured the disk then, found it still short and evicted the next step too."""
    store = LocalStore(tmp_path / "root", spare_max_bytes=10 * MiB)
    store.recover()
    store.step_dir("j", 1).mkdir(parents=True)
    (store.step_dir("j", 1) / "rank-00000.safetensors").write_bytes(b"\x07" * MiB)
    store.evict("j", 1)
    (spare,) = store.spare_root.iterdir()
    deleting, release, progress = threading.Event(), threading.Event(), threading.Event()
    unlink = Path.unlink

    def held_unlink(self: Path, missing_ok: bool = False) -> None:
        deleting.set()  # the first drop took the spares and is deleting them
        assert release.wait(60)
        unlink(self, missing_ok=missing_ok)

    seen: list[bool] = []

    def second() -> None:
        store.drop_spares()
        seen.append(spare.exists())  # True: returned while its space is still held
        progress.set()

    monkeypatch.setattr(Path, "unlink", held_unlink)
    first, other = threading.Thread(target=store.drop_spares), threading.Thread(target=second)
    first.start()
    try:
        assert deleting.wait(60)
        store._drop_lock = Announced(store._drop_lock, progress)  # type: ignore[assignment]
        other.start()
        assert progress.wait(60)  # the second drop returned, or waits for the first
    finally:
        release.set()
        first.join(60)
    other.join(60)
    assert seen == [False]
