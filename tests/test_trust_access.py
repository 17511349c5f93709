"""Two real users against one root-run daemon: job owners, leases and sessions.

- A root written before job owners were recorded (no ``<root>/.owners``) keeps
  each job its owner's: from its files, else closed until ``ckptd own``.
- A refused call claims no job.
- A lease follows the process it was granted to: it comes back when that
  process exits (whoever locks its liveness file) or stays away past
  ``lease_timeout_seconds`` with no session.
- One user cannot hold every session of the daemon.

Users come from tests/test_security.py's helpers (created when running as root;
skipped otherwise, saying why); they act through tests/access_worker.py.
"""

from __future__ import annotations

import json
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.daemon.app.launcher import DaemonProcess
from ckptd.proto import ckptd_pb2 as pb
from tests.test_security import USERS, _python, as_user, two_user_daemon

WORKER = Path(__file__).with_name("access_worker.py")
CKPTD = [sys.executable, "-m", "ckptd.daemon.app.cli"]
PER_UID = 3
WAIT = 120.0
"""Bound on waits for a daemon-side state change: a failure, not a timing."""


class Node:
    """The daemon and a way to act as either user."""

    def __init__(self, base: Path, daemon: DaemonProcess) -> None:
        self.base, self.daemon = base, daemon

    def _cmd(self, action: str, job: str, *args: str) -> list[str]:
        return [*_python(), str(WORKER), str(self.daemon.socket), action, job, *args]

    def run(self, user: str, action: str, job: str, *args: str) -> dict[str, Any]:
        out = subprocess.run(
            **as_user(user, self._cmd(action, job, *args)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return result

    def start(self, user: str, action: str, job: str, *args: str) -> Worker:
        proc = subprocess.Popen(
            **as_user(user, self._cmd(action, job, *args)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        return Worker(proc)

    def wait_until(self, what: str, done: Callable[[], bool]) -> None:
        """Until ``done()``; fails (saying what) only if it never comes."""
        deadline = time.monotonic() + WAIT
        while not done():
            assert time.monotonic() < deadline, f"{what} did not happen; {self.daemon.log_tail()}"
            time.sleep(0.05)


class Worker:
    """A worker process that keeps what it got until told."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the worker exited early"
        result: dict[str, Any] = json.loads(line)
        return result

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    args = ["--sessions-per-uid", str(PER_UID), "--lease-timeout-seconds", "1"]
    with two_user_daemon("cktr", args) as (base, daemon):
        yield Node(base, daemon)


def uid(user: str) -> int:
    return pwd.getpwnam(user).pw_uid


def test_old_root_jobs_stay_their_owners(node: Node) -> None:
    a, b = USERS
    root = node.daemon.root
    assert node.run(a, "save", "old-watched", "1") == {"ok": True}
    assert node.run(a, "watch", "old-watched", "")["ok"]  # a's watch: evidence of a
    assert node.run(a, "save", "old-plain", "1") == {"ok": True}  # only root's files
    node.daemon.stop()
    shutil.rmtree(root / ".owners")  # as a release that kept no owner records left it
    node.daemon.start()
    got = node.run(b, "restore", "old-watched")
    assert got.get("error") == "PERMISSION_DENIED", got
    assert node.run(a, "restore", "old-watched")["ok"]
    assert (root / ".owners" / "old-watched").read_text() == str(uid(a))
    for user in (b, a):  # nothing tells whose it is: closed to every user
        for action, *args in (("restore",), ("save", "2")):
            got = node.run(user, action, "old-plain", *args)
            assert got.get("error") == "PERMISSION_DENIED", (user, action, got)
            assert "ckptd own old-plain" in got["message"], got
    own = subprocess.run(
        [*CKPTD, "own", "old-plain", a, "--root", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert own.returncode == 0, own.stderr
    assert node.run(a, "restore", "old-plain")["ok"]  # the running daemon reads it
    assert node.run(b, "restore", "old-plain").get("error") == "PERMISSION_DENIED"
    again = subprocess.run(
        [*CKPTD, "own", "old-plain", b, "--root", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert again.returncode != 0 and "already belongs" in again.stderr
    assert "Traceback" not in again.stderr


@pytest.mark.parametrize("action", [["restore"], ["prefetch"], ["ensure", ""]])
def test_did_you_mean_offers_only_the_callers_jobs(node: Node, action: list[str]) -> None:
    a, b = USERS
    if node.run(a, "status", "alice-llm-secret-run", "1").get("state") != pb.SAVE_STATE_LOCAL:
        assert node.run(a, "save", "alice-llm-secret-run", "1") == {"ok": True}
        assert node.run(b, "save", "bob-llm-run", "1") == {"ok": True}
    got = node.run(b, action[0], "alice-llm-secret-rnu", *action[1:])  # close to a's job
    assert got.get("error") == "NOT_FOUND", got
    assert "alice-llm-secret-run" not in got["message"], got
    got = node.run(a, action[0], "alice-llm-secret-rnu", *action[1:])  # a's own: offered
    assert "did you mean 'alice-llm-secret-run'" in got.get("message", ""), got
    got = node.run(b, action[0], "bob-llm-rnu", *action[1:])
    assert "did you mean 'bob-llm-run'" in got.get("message", ""), got


def test_a_refused_lease_claims_no_job(node: Node) -> None:
    a, b = USERS
    got = node.run(a, "acquire", "junk-1", str(2**50))  # over the staging budget
    assert got.get("error") == "RESOURCE_EXHAUSTED", got
    assert not (node.daemon.root / ".owners" / "junk-1").exists()
    assert node.run(b, "save", "junk-1", "1") == {"ok": True}  # still nobody's: b's now
    assert (node.daemon.root / ".owners" / "junk-1").read_text() == str(uid(b))


def test_a_lock_on_a_dead_clients_liveness_file_keeps_no_lease(node: Node) -> None:
    a, b = USERS
    holder = node.start(a, "hold-live", "live-a")
    locker: Worker | None = None
    try:
        lease = holder.read()
        assert lease["ok"], lease
        assert node.daemon.status().leases_held == 1
        locker = node.start(b, "flock", "x", lease["holder"])  # b locks a's file
        assert locker.read() == {"ok": True}
        holder.proc.kill()  # a dies without committing; b keeps the lock
        holder.proc.wait()
        # A save takes back the leases of clients whose liveness file nobody locks.
        assert node.run(b, "save", "live-b", "1") == {"ok": True}
        node.wait_until("a's lease came back", lambda: node.daemon.status().leases_held == 0)
    finally:
        holder.stop()
        if locker is not None:
            locker.stop()


def test_a_lease_comes_back_when_its_process_keeps_no_session(node: Node) -> None:
    a = USERS[0]
    holder = node.start(a, "hold-live", "idle-a")
    try:
        assert holder.read()["ok"]
        assert node.daemon.status().leases_held == 1
        holder.send("close-session")  # alive, its liveness file locked, no session
        assert holder.read() == {"ok": True}
        node.wait_until(
            "the lease of a process without a session came back",
            lambda: node.daemon.status().leases_held == 0,
        )
        assert holder.proc.poll() is None  # taken back from a live process
    finally:
        holder.stop()


def test_one_user_cannot_hold_every_session(node: Node) -> None:
    a, b = USERS
    hog = node.start(a, "sessions", "x", str(PER_UID + 2))
    try:
        got = hog.read()["sessions"]
        assert got[:PER_UID] == ["ok"] * PER_UID, got
        for refusal in got[PER_UID:]:
            assert refusal.startswith("RESOURCE_EXHAUSTED") and "sessions_per_uid" in refusal
            assert "close clients" in refusal
        assert node.run(b, "save", "fair-b", "1") == {"ok": True}  # b still gets one
    finally:
        hog.stop()
    assert node.run(a, "save", "fair-a", "1") == {"ok": True}  # a's slots came back
