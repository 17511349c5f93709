"""Staging memory among users: one uid cannot hold it all, and capacity errors
never name another user's jobs.

Unit tests drive the pool directly (uids are numbers there); the integration
tests run a root daemon and two real users (tests/test_security.py's), skipped
with the reason when not root.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.core.errors import ResourceExhausted
from ckptd.daemon.app.launcher import DaemonProcess
from ckptd.daemon.local.staging import SEGMENT_GRANULE, Staging, StagingBusy

from .test_security import (
    GROUP,
    USERS,
    Node,
    _ensure_users,
    _python,
    as_user,
    remove_segment_dir,
)
from .test_trust_access import WORKER as ACCESS_WORKER
from .test_trust_access import Worker

G = SEGMENT_GRANULE
A, B = (1000, 11), (1001, 12)  # (uid, pid) of two users' processes
_PIPES: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}


def _staging(tmp_path: Path, share: float = 1.0) -> Staging:
    return Staging("ckptd-share-", 4 * G, 600.0, shm_dir=tmp_path, share_per_uid=share)


def test_a_uid_gets_no_more_than_its_configured_share(tmp_path: Path) -> None:
    st = _staging(tmp_path, share=0.5)

    async def scenario() -> None:
        held = [await st.acquire("ja", G, owner=A) for _ in range(2)]  # half the budget
        with pytest.raises(StagingBusy, match=r"staging_share_per_uid 0\.5"):
            await st.acquire("ja", G, owner=A)
        other = await st.acquire("jb", 2 * G, owner=B)  # the other half is left for b
        assert other.segment.uid == B[0]
        st.release(held[0].lease_id)
        assert (await st.acquire("ja", G, owner=A)).segment.uid == A[0]
        with pytest.raises(ResourceExhausted, match="one user's share"):
            await st.acquire("ja", 3 * G, owner=A)  # could never fit: no waiting
        st.close()

    asyncio.run(scenario())


def test_while_another_uid_waits_a_uid_over_its_fair_part_waits_too(tmp_path: Path) -> None:
    st = _staging(tmp_path)  # no configured share: only the waiting rule

    async def scenario() -> None:
        held = [await st.acquire("ja", G, owner=A) for _ in range(4)]  # the whole budget
        waiter = asyncio.create_task(st.acquire("jb", G, owner=B, wait_seconds=600))
        for _ in range(1000):  # until b's acquire is parked, waiting for memory
            if getattr(st, "_waiting", None):
                break
            await asyncio.sleep(0)
        st.release(held[0].lease_id)
        # a holds 3 granules, more than half: the freed memory is b's, not a's.
        try:
            with pytest.raises(StagingBusy, match="1 other user"):
                await st.acquire("ja", G, owner=A)
        except BaseException:
            waiter.cancel()  # fail now, not when b's wait runs out
            raise
        got = await waiter
        assert got.segment.uid == B[0] and not st._waiting  # b is no longer waiting
        st.release(got.lease_id)
        st.process_gone(B)  # b's trainer exited: nobody else saves
        assert (await st.acquire("ja", G, owner=A)).segment.uid == A[0]
        st.close()

    asyncio.run(scenario())


def test_while_another_uid_saves_a_uid_gets_no_more_than_its_fair_part(tmp_path: Path) -> None:
    st = _staging(tmp_path)  # the default: no configured share

    async def scenario() -> None:
        # b's trainer saved once and lives on; it holds nothing right now.
        st.release((await st.acquire("jb", G, owner=B)).lease_id)
        held = [await st.acquire("ja", G, owner=A) for _ in range(2)]  # half the budget
        with pytest.raises(StagingBusy, match="1 other user"):
            await st.acquire("ja", G, owner=A)
        other = await st.acquire("jb", 2 * G, owner=B)  # b's half is still there
        assert other.segment.uid == B[0]
        st.release(other.lease_id)
        st.process_gone(B)  # b's trainer exited: a is alone again
        held += [await st.acquire("ja", G, owner=A) for _ in range(2)]
        assert st.in_use_bytes == st.budget_bytes
        st.close()

    asyncio.run(scenario())


def test_a_uid_holding_nothing_may_take_more_than_its_fair_part(tmp_path: Path) -> None:
    st = _staging(tmp_path)

    async def scenario() -> None:
        st.release((await st.acquire("jb", G, owner=B)).lease_id)
        # One save larger than an even split still goes: a would otherwise never save.
        got = await st.acquire("ja", 3 * G, owner=A)
        assert got.segment.uid == A[0]
        st.close()

    asyncio.run(scenario())


def test_a_single_user_may_still_use_the_whole_budget(tmp_path: Path) -> None:
    st = _staging(tmp_path)

    async def scenario() -> None:
        for _ in range(4):
            await st.acquire("ja", G, owner=A)
        assert st.in_use_bytes == st.budget_bytes
        st.close()

    asyncio.run(scenario())


def test_the_budget_error_names_only_the_askers_own_jobs(tmp_path: Path) -> None:
    st = _staging(tmp_path)

    async def scenario() -> None:
        await st.acquire("private-job-of-a", 3 * G, owner=A)
        await st.acquire("mine", G, owner=B)
        with pytest.raises(StagingBusy) as info:
            await st.acquire("mine-too", G, owner=B)
        text = str(info.value)
        assert "private-job-of-a" not in text
        assert f"{3 * G} bytes by other users" in text and "jobs mine;" in text, text
        assert "wait for earlier saves" in text, text
        st.close()

    asyncio.run(scenario())


@contextlib.contextmanager
def _node(*extra: str) -> Iterator[Node]:
    _ensure_users()
    _python()  # skips, saying why, if the test users could not run the worker
    base = Path(tempfile.mkdtemp(prefix="ckshare", dir="/tmp"))
    os.chmod(base, 0o755)
    daemon = DaemonProcess(
        base / "root",
        base / "run" / "ckptd.sock",
        staging_budget=f"{2 * G}",  # two leases of the worker's size
        extra_args=["--socket-group", GROUP, *extra],
        log_path=base / "daemon.log",
    )
    daemon.start()
    try:
        yield Node(base, daemon, base)
    finally:
        daemon.stop()
        remove_segment_dir(daemon.root)
        shutil.rmtree(base, ignore_errors=True)


def _release(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(60)


def test_another_users_capacity_error_hides_the_holders_jobs() -> None:
    a, b = USERS
    with _node() as node:
        held = [node.hold_lease(a, "secret-job-of-a") for _ in range(2)]  # the whole budget
        procs = [proc for proc, _ in held]
        try:
            assert all("lease_id" in lease for _, lease in held), held
            proc, got = node.hold_lease(b, "job-b")
            _release(proc)
            assert got.get("error") == "RESOURCE_EXHAUSTED", got
            assert "secret-job-of-a" not in got["message"], got
            assert f"{2 * G} bytes by other users" in got["message"], got
        finally:
            _release(*procs)


def test_a_configured_share_leaves_room_for_another_user() -> None:
    a, b = USERS
    with _node("--staging-share-per-uid", "0.5") as node:
        first, lease = node.hold_lease(a, "ja")
        procs: list[Any] = [first]
        try:
            assert "lease_id" in lease, lease
            more, got = node.hold_lease(a, "ja")
            procs.append(more)
            assert got.get("error") == "RESOURCE_EXHAUSTED", got
            assert "staging_share_per_uid" in got["message"], got
            other, got = node.hold_lease(b, "jb")
            procs.append(other)
            assert "lease_id" in got, got
        finally:
            _release(*procs)


def test_a_user_saving_keeps_its_fair_part_while_another_holds_leases() -> None:
    a, b = USERS
    with _node() as node:  # the default share
        cmd = [*_python(), str(ACCESS_WORKER), str(node.daemon.socket), "save-again", "jb", "1"]
        trainer = Worker(subprocess.Popen(**as_user(b, [*cmd, "5"]), **_PIPES))
        procs: list[Any] = []
        try:
            assert trainer.read().get("ok"), "b's first save failed"  # b's trainer lives on
            first, lease = node.hold_lease(a, "ja")
            procs.append(first)
            assert "lease_id" in lease, lease
            more, got = node.hold_lease(a, "ja")  # the rest of the budget: b's part
            procs.append(more)
            assert got.get("error") == "RESOURCE_EXHAUSTED", got
            assert "1 other user" in got["message"], got
            trainer.send("save")
            assert trainer.read() == {"ok": True}  # not held back by a's leases
            trainer.stop()  # b's trainer exits: a may use the whole budget again
            deadline = time.monotonic() + 120
            while "lease_id" not in got:  # until the daemon saw b's process go
                assert time.monotonic() < deadline, got
                _release(more)
                more, got = node.hold_lease(a, "ja")
                procs[-1] = more
        finally:
            _release(*procs)
            trainer.stop()


@pytest.mark.parametrize("value", ["0", "1.5", "-0.5"])
def test_a_share_outside_zero_to_one_stops_start_up_saying_what_is_accepted(value: str) -> None:
    from ckptd.daemon.app.config import ConfigError, load

    with pytest.raises(ConfigError, match=r"staging_share_per_uid.*at most 1"):
        load(env={"CKPTD_STAGING_SHARE_PER_UID": value})
    assert load(env={"CKPTD_STAGING_SHARE_PER_UID": "0.25"}).staging_share_per_uid == 0.25
    assert load(env={}).staging_share_per_uid == 1.0
