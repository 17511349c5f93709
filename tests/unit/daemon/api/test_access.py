"""Job owners, lease liveness and sessions per uid, unit by unit (no second user needed).

The two-user versions run a real daemon in tests/test_trust_access.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.core.errors import PermissionDenied, ResourceExhausted
from ckptd.core.session import Session
from ckptd.daemon.api import owners
from ckptd.daemon.api.access import Access
from ckptd.daemon.api.sessions import Peer, SessionServer
from ckptd.daemon.app.config import Config
from ckptd.daemon.app.options import Options
from ckptd.daemon.local.liveness import process_start, wait_gone
from ckptd.daemon.local.staging import Staging
from ckptd.daemon.remote import index

USER, OTHER = 100_001, 100_002  # neither is an operator (root or the test's uid)


def peer(uid: int, pid: int = 7) -> Peer:
    return Peer(uid, uid, frozenset({uid}), pid, f"token-{uid}-{pid}")


def access(tmp_path: Path) -> Access:
    root = tmp_path / "root"
    root.mkdir()
    acc = Access(root, Staging("ckptd-test-", 8 * 2**20, 10.0, shm_dir=tmp_path))
    acc.load()
    return acc


def test_a_refused_call_claims_no_job(tmp_path: Path) -> None:
    acc = access(tmp_path)
    with pytest.raises(ResourceExhausted), acc.claiming(peer(USER), "j"):
        raise ResourceExhausted("over budget")
    assert acc.owner_of("j") is None and not (acc.root / ".owners" / "j").exists()
    with acc.claiming(peer(OTHER), "j"):  # nobody's still: the next to succeed owns it
        pass
    assert (acc.root / ".owners" / "j").read_text() == str(OTHER)
    with pytest.raises(PermissionDenied, match="belongs to uid"):
        acc.check_job(peer(USER), "j")


def test_a_job_is_reserved_while_its_first_call_runs(tmp_path: Path) -> None:
    acc = access(tmp_path)
    first = acc.claiming(peer(USER), "j")
    first.__enter__()
    with pytest.raises(PermissionDenied):  # another uid, meanwhile
        acc.check_job(peer(OTHER), "j")
    acc.allow_uids = frozenset({OTHER + 1})
    with acc.claiming(peer(OTHER + 1), "j"):  # allowed on every job: uses it, claims nothing
        assert acc.owner_of("j") == USER
    second = acc.claiming(peer(USER, pid=8), "j")  # the same uid joins the reservation
    second.__enter__()
    refused = ValueError("refused")
    assert not first.__exit__(ValueError, refused, None)  # the refusal goes on up
    assert acc.owner_of("j") == USER  # the second call still runs
    second.__exit__(None, None, None)
    assert (acc.root / ".owners" / "j").read_text() == str(USER)


def test_the_sharing_keys_reach_access_through_the_api_options(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    config = Config(
        root=root,
        socket=tmp_path / "s.sock",
        allow_gids=(OTHER,),
        shared_jobs=("team-*",),
        sessions_per_uid=3,
    )
    api = Options.of(config).api
    assert (api.socket_gid, api.sessions_per_uid) == (-1, 3)  # no socket_group: none
    assert api.sharing.any and not Options.of(Config(root=root)).api.sharing.any
    acc = Access(root, Staging("ckptd-test-", 8 * 2**20, 10.0, shm_dir=tmp_path), api.sharing)
    acc.load()
    for job in ("mine", "team-a"):
        with acc.claiming(peer(USER), job):
            pass
    acc.check_job(peer(OTHER), "mine")  # a member of an allowed group: every job
    acc.check_job(peer(OTHER + 1), "team-a")  # a shared job: anyone
    with pytest.raises(PermissionDenied, match="belongs to uid"):
        acc.check_job(peer(OTHER + 1), "mine")


def test_a_root_without_records_gets_owners_from_its_files(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "mine" / "1").mkdir(parents=True)
    (root / "mine" / "1" / "rank-0").write_text("x")
    (root / "watched").mkdir()
    (root / ".watched.json").write_text(
        json.dumps({"watched": {"directory": "/x", "caller": {"uid": OTHER, "groups": []}}})
    )
    me = os.geteuid()
    found = owners.infer(root, frozenset({0}) - {me})  # the test's uid plays a user here
    assert found == {"mine": me, "watched": OTHER}
    assert owners.infer(root, frozenset({0, me})) == {
        "mine": owners.UNASSIGNED,  # only operators' files: closed
        "watched": OTHER,
    }


def test_a_closed_job_opens_to_the_user_ckptd_own_names(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "old" / "1").mkdir(parents=True)
    acc = Access(root, Staging("ckptd-test-", 8 * 2**20, 10.0, shm_dir=tmp_path))
    acc.load()  # no .owners: "old" has only the daemon's (an operator's) files
    assert acc.owner_of("old") == owners.UNASSIGNED
    for uid in (USER, OTHER):
        with pytest.raises(PermissionDenied, match="ckptd own old"):
            acc.check_job(peer(uid), "old")
    assert owners.assign(root, "old", USER) == owners.UNASSIGNED
    acc.check_job(peer(USER), "old")  # read at its next use, no restart
    with pytest.raises(PermissionDenied):
        acc.check_job(peer(OTHER), "old")
    with pytest.raises(Exception, match="already belongs"):
        owners.assign(root, "old", OTHER)


def test_wait_gone_follows_the_process_not_its_pid(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    started = process_start(child.pid)
    assert started is not None

    async def scenario() -> None:
        waiting = asyncio.ensure_future(wait_gone(child.pid, started, 3600.0))
        await asyncio.sleep(0)
        assert not waiting.done()
        child.kill()
        assert await waiting  # at the exit (a zombie counts), not after the hour
        # A pid whose start time differs names another process: gone at once.
        assert await wait_gone(os.getpid(), (process_start(os.getpid()) or 0) + 1, 3600.0)
        # A live process: still there when the wait ends.
        assert not await wait_gone(os.getpid(), process_start(os.getpid()), 0.01)

    asyncio.run(asyncio.wait_for(scenario(), 600))
    child.wait()


def test_sessions_per_uid_and_the_exit_of_a_sessions_process(tmp_path: Path) -> None:
    gone: list[tuple[int, int]] = []
    sock = tmp_path / "s.sock"

    async def scenario() -> None:
        server = SessionServer(
            sock, {}, on_process_gone=gone.append, idle_seconds=3600.0, per_uid=1
        )
        await server.start()
        try:
            first = Session(str(sock))
            await asyncio.to_thread(first.metadata)
            second = Session(str(sock))
            with pytest.raises(ResourceExhausted, match="sessions_per_uid = 1"):
                await asyncio.to_thread(second.metadata)
            first.close()
            while server.sessions:  # the server saw it close
                await asyncio.sleep(0.01)
            # The process that held it lives on: its leases stay for idle_seconds.
            await asyncio.to_thread(second.metadata)
            assert gone == []
            second.close()
            while server.sessions:
                await asyncio.sleep(0.01)
            # A process that opened a session and exited: gone as soon as it exits.
            code = (
                "import socket,sys; s=socket.socket(socket.AF_UNIX); "
                f"s.connect({str(sock) + '.session'!r}); s.recv(4096)"
            )
            child = await asyncio.create_subprocess_exec(sys.executable, "-c", code)
            await child.wait()
            while not gone:
                await asyncio.sleep(0.01)
            assert gone == [(os.geteuid(), child.pid)]
        finally:
            await server.stop()

    asyncio.run(asyncio.wait_for(scenario(), 600))


def test_a_full_staging_budget_names_only_the_callers_jobs(tmp_path: Path) -> None:
    st = Staging("ckptd-test-", 8 * 2**20, 10.0, shm_dir=tmp_path)

    async def scenario() -> None:
        await st.acquire("secret-project", 4 * 2**20, owner=(OTHER, 1))
        await st.acquire("my-job", 4 * 2**20, owner=(USER, 2))
        with pytest.raises(ResourceExhausted) as refused:
            await st.acquire("my-job", 4 * 2**20, wait_seconds=0, owner=(USER, 3))
        assert "my-job" in str(refused.value) and "other users'" in str(refused.value)
        assert "secret-project" not in str(refused.value)
        st.close()

    asyncio.run(scenario())


def test_a_job_from_the_bucket_comes_back_with_its_owner(tmp_path: Path) -> None:
    """A node that lost its disk reads each job's owner from its index in the bucket:
    nobody else may use the job, and the record is kept on disk for the next start."""
    entries = {4: index.Entry(4)}
    raw = index.encode("j", "n", entries, owner=USER)
    assert index._decode(raw, "k")[2] == (USER, True)
    acc = access(tmp_path)
    acc.found_in_bucket("j", *index._decode(raw, "k")[2])
    assert acc.owner_of("j") == USER and (acc.root / ".owners" / "j").read_text() == str(USER)
    with pytest.raises(PermissionDenied, match="belongs to uid"):
        acc.check_job(peer(OTHER), "j")
    acc.check_job(peer(USER), "j")
    # An index written before owners were recorded: closed until `ckptd own`.
    body = json.loads(raw)
    del body["owner"]
    acc.found_in_bucket("old", *index._decode(json.dumps(body).encode(), "k")[2])
    with pytest.raises(PermissionDenied, match="ckptd own old"):
        acc.check_job(peer(USER), "old")
    # An operator's job (no owner) stays open; a value no ckptd writes counts as none.
    acc.found_in_bucket("ops", *index._decode(index.encode("ops", "n", entries), "k")[2])
    assert acc.owner_of("ops") is None
    body["owner"] = "root"
    assert index._decode(json.dumps(body).encode(), "k")[2] == (None, False)


def test_the_roots_own_records_rule_over_the_buckets(tmp_path: Path) -> None:
    acc = access(tmp_path)
    with acc.claiming(peer(USER), "mine"):
        pass
    acc.found_in_bucket("mine", OTHER, True)  # recorded here: the bucket's word is not taken
    assert acc.owner_of("mine") == USER
    # Files back from a peer after a node loss, no record: the bucket's owner counts.
    (acc.root / "back" / "3").mkdir(parents=True)
    acc.found_in_bucket("back", OTHER, True)
    assert acc.owner_of("back") == OTHER
