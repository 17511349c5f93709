"""Admission alone, with the free space injected: refusals at the floor, no bucket I/O."""

from __future__ import annotations

import asyncio
from pathlib import Path

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
