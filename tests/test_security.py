"""Two real users against one daemon running as root: what each may and may not do.

The daemon runs as root (more rights than its callers, as a sidecar often does);
users ``ckptd-ta`` and ``ckptd-tb`` are members of the socket group
``ckptd-clients`` and call it through tests/security_worker.py. Created here when
running as root; skipped otherwise (the reason says why).
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from ckptd.daemon.app.launcher import DaemonProcess
from ckptd.daemon.local.staging import recorded_dir

from .helpers import setpriv

WORKER = Path(__file__).with_name("security_worker.py")
GROUP = "ckptd-clients"
USERS = ("ckptd-ta", "ckptd-tb")


def _world_usable(path: str) -> bool:
    """Whether any user may execute ``path`` (every directory above it searchable)."""
    real = Path(os.path.realpath(path))
    if not real.stat().st_mode & stat.S_IXOTH:
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in real.parents)


def _python() -> list[str]:
    """An interpreter the test users may run, loading this venv's packages.

    The venv's own interpreter may live under a directory only root may enter
    (pyenv under /root): then the system's python of the same version runs the
    worker with the venv's site-packages added (same ABI).
    """
    for needed in (
        WORKER,
        Path(__file__).resolve().parents[1] / "src" / "ckptd" / "core" / "session.py",
    ):
        if not all(p.stat().st_mode & stat.S_IXOTH for p in Path(needed).resolve().parents):
            pytest.skip(f"{needed} is not reachable by other users (a directory above lacks o+x)")
    if _world_usable(sys.executable):
        return [sys.executable]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        if os.path.exists(candidate) and _world_usable(candidate):
            site = next(p for p in sys.path if p.endswith("site-packages") and sys.prefix in p)
            return [
                candidate,
                "-c",
                f"import site,runpy,sys; site.addsitedir({site!r}); "
                "sys.argv=sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')",
            ]
    pytest.skip(f"no {version} that other users may run ({sys.executable} is not)")


def _ensure_users() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create two users and run a daemon with more rights")
    if not shutil.which("useradd") or not shutil.which("groupadd"):
        pytest.skip("useradd/groupadd are not installed")
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        subprocess.run(["groupadd", GROUP], check=True, timeout=60)
    for user in USERS:
        try:
            pwd.getpwnam(user)
        except KeyError:
            subprocess.run(
                ["useradd", "-M", "-N", "-G", GROUP, "-s", "/usr/sbin/nologin", user],
                check=True,
                timeout=60,
            )


def as_user(user: str, argv: Sequence[str]) -> dict[str, Any]:
    """``subprocess`` keyword arguments, ``args`` among them, running ``argv`` as
    ``user``, a member of the socket group.

    The switch is setpriv's, after the exec (:func:`tests.helpers.setpriv`)."""
    return {"args": [*setpriv(user, GROUP), *argv], "env": {**os.environ, "HOME": "/tmp"}}


@contextlib.contextmanager
def two_user_daemon(prefix: str, extra_args: list[str]) -> Iterator[tuple[Path, DaemonProcess]]:
    """A root daemon whose socket both test users reach (group ``GROUP``), in a fresh
    world-searchable directory under /tmp; ``(that directory, the daemon)``. Skips,
    saying why, where the users cannot be made or cannot run the worker."""
    _ensure_users()
    _python()
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(base, 0o755)  # the users reach the socket through it
    daemon = DaemonProcess(
        base / "root",
        base / "run" / "ckptd.sock",
        extra_args=["--socket-group", GROUP, *extra_args],
        log_path=base / "daemon.log",
    )
    daemon.start()
    try:
        yield base, daemon
    finally:
        daemon.stop()
        remove_segment_dir(daemon.root)
        shutil.rmtree(base, ignore_errors=True)


def remove_segment_dir(root: Path) -> None:
    """Remove the segment directory ``root`` records (a killed daemon leaves it)."""
    seg_dir = recorded_dir(root)
    if seg_dir is not None:
        shutil.rmtree(seg_dir, ignore_errors=True)


class Node:
    """The daemon, its directories, and a way to act as either user."""

    def __init__(self, base: Path, daemon: DaemonProcess, adopt_dir: Path) -> None:
        self.base, self.daemon, self.adopt_dir = base, daemon, adopt_dir

    def run(self, user: str, action: str, job: str, *args: str) -> dict[str, Any]:
        proc = subprocess.Popen(
            **as_user(user, [*_python(), str(WORKER), str(self.daemon.socket), action, job, *args]),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            # Not subprocess.run's kill-then-wait-forever: a worker the kill cannot
            # end (stuck in the kernel) fails this test instead of hanging the run.
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=10)
            raise AssertionError(f"{user}'s {action} did not finish in 120 s") from None
        assert proc.returncode == 0, stderr
        result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
        return result

    def hold_lease(self, user: str, job: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
        proc = subprocess.Popen(
            **as_user(user, [*_python(), str(WORKER), str(self.daemon.socket), "hold-lease", job]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        return proc, json.loads(proc.stdout.readline())


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    _ensure_users()
    _python()  # skips, saying why, if the test users could not run the worker
    base = Path(tempfile.mkdtemp(prefix="cksec", dir="/tmp"))
    os.chmod(base, 0o755)  # the users reach the socket and the adopt dir through it
    adopt_dir = base / "adopt"
    adopt_dir.mkdir(mode=0o1777)
    os.chmod(adopt_dir, 0o1777)  # like /tmp: everyone may create, nobody may replace
    daemon = DaemonProcess(
        base / "root",
        base / "run" / "ckptd.sock",
        extra_args=[
            "--socket-group",
            GROUP,
            "--adopt-dirs",
            str(adopt_dir),
            "--shared-jobs",
            "shared-*",
        ],
        log_path=base / "daemon.log",
    )
    daemon.start()
    try:
        yield Node(base, daemon, adopt_dir)
    finally:
        daemon.stop()
        remove_segment_dir(daemon.root)
        shutil.rmtree(base, ignore_errors=True)


def test_modes_root_socket_and_segments(node: Node) -> None:
    root, sock = node.daemon.root, node.daemon.socket
    assert stat.S_IMODE(root.stat().st_mode) == 0o750
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o750
    assert sock.parent.stat().st_gid == grp.getgrnam(GROUP).gr_gid
    for path in (sock, Path(str(sock) + ".session")):
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        assert path.stat().st_gid == grp.getgrnam(GROUP).gr_gid
    assert node.run("ckptd-ta", "save", "modes", "1") == {"ok": True}
    seg_dir = recorded_dir(root)
    assert seg_dir is not None
    assert stat.S_IMODE(seg_dir.lstat().st_mode) == 0o700 and seg_dir.lstat().st_uid == 0
    segments = list(seg_dir.iterdir())
    assert segments
    for seg in segments:
        assert stat.S_IMODE(seg.stat().st_mode) == 0o600 and seg.stat().st_uid == 0


def test_a_job_belongs_to_the_uid_that_first_saved_it(node: Node) -> None:
    a, b = USERS
    assert node.run(a, "save", "ja", "1") == {"ok": True}
    assert node.run(a, "restore", "ja")["ok"]
    assert node.run(a, "restore-files", "ja")["ok"]  # files handed over by the session
    for action, *args in (
        ("restore",),
        ("restore-files",),
        ("save", "2"),
        ("pin", "1"),
        ("status", "1"),
        ("adopt", "3", str(node.adopt_dir)),
        ("watch", ""),
    ):
        got = node.run(b, action, "ja", *args)
        assert got.get("error") == "PERMISSION_DENIED", (action, got)
        assert "belongs to uid" in got["message"] and "allow_uids" in got["message"]
    assert "ja" not in node.run(b, "list", "x")["jobs"]
    assert "ja" in node.run(a, "list", "x")["jobs"]
    owner = (node.daemon.root / ".owners" / "ja").read_text()
    assert owner == str(pwd.getpwnam(a).pw_uid)


def test_shared_jobs_are_open_to_every_socket_user(node: Node) -> None:
    a, b = USERS
    assert node.run(a, "save", "shared-run", "1") == {"ok": True}
    assert node.run(b, "restore", "shared-run")["ok"]


def test_a_lease_is_only_for_the_process_it_was_granted_to(node: Node) -> None:
    a, b = USERS
    proc, lease = node.hold_lease(a, "lease-a")
    try:
        # By name: the segment is root's and 0600.
        seg_dir = recorded_dir(node.daemon.root)
        assert seg_dir is not None
        path = seg_dir / lease["segment"]
        assert node.run(b, "open-shm", "x", str(path))["errno"] == 13
        # Over b's own session: granted to another process.
        got = node.run(b, "open-lease", "x", lease["lease_id"])
        assert got.get("error") == "PERMISSION_DENIED", got
        # Even the same user, from another process, gets no descriptor of it.
        got = node.run(a, "open-lease", "lease-a", lease["lease_id"])
        assert got.get("error") == "PERMISSION_DENIED", got
        got = node.run(b, "commit-foreign", "job-b", lease["lease_id"])
        assert got.get("error") == "PERMISSION_DENIED", got
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(60)


def test_adopt_reads_only_what_the_caller_could_read(node: Node) -> None:
    b = USERS[1]
    secret_dir = node.adopt_dir / "root-secrets"
    secret_dir.mkdir()
    os.chmod(secret_dir, 0o755)
    (secret_dir / "credentials").write_text("root-only")
    os.chmod(secret_dir / "credentials", 0o600)
    got = node.run(b, "adopt", "adopt-b", "1", str(secret_dir))
    assert got.get("error") == "PERMISSION_DENIED" and "not readable" in got["message"]
    # Outside adopt_dirs, straight or through a symlink inside it.
    got = node.run(b, "adopt", "adopt-b", "2", "/etc")
    assert got.get("error") == "PERMISSION_DENIED" and "adopt_dirs" in got["message"]
    link = node.adopt_dir / "to-etc"
    link.symlink_to("/etc")
    got = node.run(b, "adopt", "adopt-b", "3", str(link))
    assert got.get("error") == "PERMISSION_DENIED" and "adopt_dirs" in got["message"]
    assert node.run(b, "list", "x")["jobs"].count("adopt-b") == 0


def test_watch_and_put_back_write_only_where_the_caller_may(node: Node) -> None:
    b = USERS[1]
    outside = node.base / "outside"
    got = node.run(b, "watch", "watch-b", str(outside / "new"))
    assert got.get("error") == "PERMISSION_DENIED" and "adopt_dirs" in got["message"]
    (node.adopt_dir / "escape").symlink_to(outside)
    got = node.run(b, "watch", "watch-b", str(node.adopt_dir / "escape" / "new"))
    assert got.get("error") == "PERMISSION_DENIED"
    got = node.run(b, "ensure", "watch-b", str(node.adopt_dir / "escape"))
    assert got.get("error") == "PERMISSION_DENIED"
    assert not outside.exists()  # nothing created outside, by either route
    locked = node.adopt_dir / "roots-dir"
    locked.mkdir(mode=0o755)
    got = node.run(b, "watch", "watch-b", str(locked / "orbax"))
    assert got.get("error") == "PERMISSION_DENIED" and "not writable" in got["message"]
    assert not (locked / "orbax").exists()
    mine = node.adopt_dir / "b-orbax"
    got = node.run(b, "watch", "watch-b", str(mine))
    assert got == {"ok": True, "directory": str(mine)}
    assert mine.stat().st_uid == pwd.getpwnam(b).pw_uid  # created for b, who writes there


def test_a_step_put_back_lands_in_the_callers_directory_readable_by_it(node: Node) -> None:
    b = USERS[1]
    mine = node.adopt_dir / "b-put-back"
    assert node.run(b, "watch", "put-b", str(mine))["ok"]
    assert node.run(b, "orbax-step", "put-b", str(mine), "5") == {"ok": True}
    assert node.run(b, "watch", "put-b", str(mine))["ok"]  # a watch scans at once: adopted
    assert node.run(b, "remove-step", "put-b", str(mine), "5") == {"ok": True}
    got = node.run(b, "ensure", "put-b", str(mine))
    assert got == {"ok": True, "path": str(mine / "5")}, got
    read = node.run(b, "read", "put-b", str(mine / "5" / "data"))
    assert read["text"] == "b's weights" and read["uid"] == pwd.getpwnam(b).pw_uid
    assert (mine / "5").stat().st_uid == pwd.getpwnam(b).pw_uid
