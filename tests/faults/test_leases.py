"""Leases without a daemon process: the fd limit, liveness and what capacity errors say."""

from __future__ import annotations

import asyncio
import fcntl
import os
import resource
from pathlib import Path

import pytest

from ckptd.core.errors import ResourceExhausted
from ckptd.daemon.local.liveness import sweep_dead_clients
from ckptd.daemon.local.staging import SEGMENT_GRANULE, Staging


def test_many_segments_need_no_file_descriptors(tmp_path: Path) -> None:
    # Each mmap.mmap used to keep a dup of its fd: hundreds of small leases under
    # `ulimit -n 256` ended in EMFILE and every later save failed.
    st = Staging("ckptd-fd-", 420 * SEGMENT_GRANULE, 600.0, shm_dir=tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_before = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_before + 64, hard))
    try:

        async def many() -> int:
            leases = [await st.acquire("j", SEGMENT_GRANULE) for _ in range(400)]
            for i, lease in enumerate(leases):
                lease.segment.view(0, 8)[:] = i.to_bytes(8, "little")
            return len(leases)

        assert asyncio.run(many()) == 400
        assert len(os.listdir("/proc/self/fd")) <= open_before + 2
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        st.close()
    assert list(tmp_path.iterdir()) == []


def _liveness_file(shm: Path, pid: int) -> tuple[str, int]:
    name = f"ckptd-client-{pid}-{'ab' * 8}"
    fd = os.open(shm / name, os.O_CREAT | os.O_RDONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return name, fd


def test_a_dead_clients_lease_comes_back_at_once_and_errors_say_who_holds_memory(
    tmp_path: Path,
) -> None:
    st = Staging("ckptd-live-", 4 * SEGMENT_GRANULE, 600.0, shm_dir=tmp_path)
    holder, fd = _liveness_file(tmp_path, 12345)

    async def scenario() -> None:
        held = await st.acquire("j", 4 * SEGMENT_GRANULE, holder=holder)
        with pytest.raises(ResourceExhausted) as busy:
            await st.acquire("k", SEGMENT_GRANULE)
        assert "leases granted to clients that have not committed yet" in str(busy.value)
        assert "jobs j" in str(busy.value)
        os.close(fd)  # the client dies: the kernel drops its lock
        again = await st.acquire("k", SEGMENT_GRANULE)  # no timeout needed
        assert not st.holds(held) and again.segment is not None

    asyncio.run(scenario())
    assert not (tmp_path / holder).exists()  # its liveness file was tidied
    st.close()


def test_sweep_keeps_live_clients_files(tmp_path: Path) -> None:
    live, fd = _liveness_file(tmp_path, 1)
    _dead, dead_fd = _liveness_file(tmp_path, 2)
    os.close(dead_fd)
    (tmp_path / "ckptd-client-not-ours").touch()  # not a liveness name: left alone
    assert sweep_dead_clients(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live, "ckptd-client-not-ours"])
    os.close(fd)


def test_malformed_holder_is_refused(tmp_path: Path) -> None:
    st = Staging("ckptd-bad-", 4 * SEGMENT_GRANULE, 600.0, shm_dir=tmp_path)
    with pytest.raises(Exception, match="malformed ckptd-holder"):
        asyncio.run(st.acquire("j", 10, holder="../../etc/passwd"))
    st.close()
