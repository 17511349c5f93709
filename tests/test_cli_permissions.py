"""``ckptd pull`` and ``ckptd verify`` run by a real user who lacks the rights: one line
that names the path and says what to do, exit 2, never a traceback; a file the user
may not read is UNREADABLE, not CORRUPT.

Root bypasses file modes, so the CLI runs as a second user (created here, as
tests/test_security.py does; skipped, saying why, when not root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import RemoteTarget
from .helpers import setpriv
from .test_remote_tier import remote_daemon
from .test_security import USERS, _ensure_users, _world_usable

USER = USERS[0]


def _cli_as_user() -> list[str]:
    """The ``ckptd`` command as the test user may run it: an interpreter they may
    execute, with this venv's packages added (the venv's own may sit under /root)."""
    code = "import site,sys; site.addsitedir(sys.argv.pop(1)); "
    code += "from ckptd.daemon.app.cli import main; sys.exit(main(sys.argv[1:]))"
    site = next(p for p in sys.path if p.endswith("site-packages") and sys.prefix in p)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        if os.path.exists(candidate) and _world_usable(candidate) and _world_usable(site):
            return [candidate, "-c", code, site]
    pytest.skip(f"no {version} that {USER} may run with this venv's packages")


@pytest.fixture
def shared_base() -> Iterator[Path]:
    """A directory every user may enter (pytest's tmp_path is root's alone)."""
    _ensure_users()
    base = Path(tempfile.mkdtemp(prefix="ckperm", dir="/tmp"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def ckptd_as_user(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*setpriv(USER), *_cli_as_user(), *args],
        env={**os.environ, "HOME": "/tmp", "CKPTD_SOCKET": "/nonexistent/ckptd.sock"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def open_to_all(path: Path) -> None:
    """Let every user read ``path`` and everything under it."""
    for d, _, files in os.walk(path):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)


def one_error_line(out: subprocess.CompletedProcess[str]) -> str:
    """The run's error: exit 2, no traceback, exactly one ``ckptd: error:`` line."""
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("ckptd: error:")]
    assert len(errors) == 1, out.stderr
    return errors[0]


@pytest.mark.parametrize("made", [False, True], ids=["dest-missing", "dest-not-writable"])
def test_pull_into_a_directory_the_user_cannot_write(
    shared_base: Path, make_daemon: Any, made: bool
) -> None:
    remote = RemoteTarget("file", f"file://{shared_base}/bucket", {})
    daemon = remote_daemon(make_daemon, remote)
    daemon.client("pj").save(1, {"x": np.arange(1000)}).wait("durable", 60)
    open_to_all(shared_base / "bucket")  # the user may read the bucket, not write DEST
    locked = shared_base / "locked"
    locked.mkdir(mode=0o755)  # root's: others may enter, not create
    dest = locked / ("made" if made else "new")
    if made:
        dest.mkdir(mode=0o755)
    out = ckptd_as_user("pull", "pj", str(dest), "--remote", remote.url)
    line = one_error_line(out)
    assert str(dest) in line and "Permission denied" in line and "pull into" in line, line
    assert not made or not any(dest.iterdir())
    assert [p.name for p in locked.iterdir()] == (["made"] if made else [])


@pytest.fixture
def local_tier(shared_base: Path, make_daemon: Any) -> Path:
    """A root with one committed step, ``vj/1``, every part readable by every user."""
    root = shared_base / "root"
    daemon = make_daemon(root=root)
    daemon.client("vj").save(1, {"x": np.arange(1000)}).wait("local", 60)
    for d in (root, root / "vj", root / "vj" / "1"):
        os.chmod(d, 0o755)
    for f in (root / "vj" / "1").iterdir():
        os.chmod(f, 0o644)
    return root


def test_verify_reports_a_file_it_cannot_read_as_unreadable(local_tier: Path) -> None:
    args = ("verify", "--root", str(local_tier), "--local-only")
    assert ckptd_as_user(*args).returncode == 0  # readable: the copy is intact
    rank = local_tier / "vj" / "1" / "rank-00000.safetensors"
    os.chmod(rank, 0o600)  # root's alone now
    out = ckptd_as_user(*args)
    line = one_error_line(out)
    assert "could not be read" in line and "run ckptd verify as" in line, line
    assert "CORRUPT" not in out.stdout, out.stdout
    assert "UNREADABLE  local vj/1" in out.stdout and rank.name in out.stdout, out.stdout
    assert "1 copies checked, 0 corrupt, 1 unreadable" in out.stdout
    os.chmod(local_tier / "vj" / "1" / "manifest.json", 0o600)  # the manifest too
    out = ckptd_as_user(*args)
    one_error_line(out)
    assert "UNREADABLE  local vj/1" in out.stdout and "CORRUPT" not in out.stdout, out.stdout


def test_verify_of_a_root_it_cannot_read_says_so(local_tier: Path) -> None:
    os.chmod(local_tier, 0o700)
    out = ckptd_as_user("verify", "--root", str(local_tier), "--local-only")
    line = one_error_line(out)
    assert f"cannot read the local tier {local_tier}" in line, line
    assert "Permission denied" in line and "nothing to verify" not in line, line
    os.chmod(local_tier, 0o755)
    os.chmod(local_tier / "vj", 0o700)  # a job directory it may not list
    out = ckptd_as_user("verify", "--root", str(local_tier), "--local-only")
    one_error_line(out)
    assert "UNREADABLE  local vj" in out.stdout, out.stdout


def test_verify_reports_a_bucket_file_it_cannot_read_as_unreadable(
    shared_base: Path, make_daemon: Any
) -> None:
    remote = RemoteTarget("file", f"file://{shared_base}/bucket", {})
    daemon = remote_daemon(make_daemon, remote)
    daemon.client("rj").save(1, {"x": np.arange(1000)}).wait("durable", 60)
    open_to_all(shared_base / "bucket")
    args = ("verify", "--remote", remote.url, "--remote-only")
    assert ckptd_as_user(*args).returncode == 0  # readable: the copy is intact
    (rank,) = (shared_base / "bucket").rglob("rank-00000.safetensors")
    os.chmod(rank, 0o600)
    out = ckptd_as_user(*args)
    one_error_line(out)
    assert "UNREADABLE  remote rj/1" in out.stdout and "CORRUPT" not in out.stdout, out.stdout
