"""Socket security and single ownership."""

from __future__ import annotations

import socket as pysocket
import stat
import subprocess
from pathlib import Path
from typing import Any

from .conftest import CKPTD, Daemon


def test_socket_is_0660_in_a_0750_directory(daemon: Daemon) -> None:
    assert stat.S_ISSOCK(daemon.socket.stat().st_mode)
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o660
    assert stat.S_IMODE(daemon.socket.parent.stat().st_mode) == 0o750


def test_second_daemon_on_a_live_socket_refuses_to_start(daemon: Daemon, tmp_path: Any) -> None:
    out = subprocess.run(
        [CKPTD, "serve", "--root", str(tmp_path / "other-root"), "--socket", str(daemon.socket)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "another ckptd" in out.stderr and str(daemon.socket) in out.stderr
    assert "Traceback" not in out.stderr
    # the first daemon is untouched and still serving
    daemon.client("x").list()
    assert daemon.proc is not None and daemon.proc.poll() is None


def test_second_daemon_on_the_same_root_refuses_to_start(make_daemon: Any, tmp_path: Path) -> None:
    first: Daemon = make_daemon()
    other_socket = tmp_path / "s" / "other.sock"
    out = subprocess.run(
        [CKPTD, "serve", "--root", str(first.root), "--socket", str(other_socket)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2  # the error the operator sees, on stderr
    assert f"root {first.root}" in out.stderr and "Traceback" not in out.stderr


def test_stale_socket_file_is_replaced(make_daemon: Any) -> None:
    d: Daemon = make_daemon(start=False)
    d.socket.parent.mkdir(parents=True)
    stale = pysocket.socket(pysocket.AF_UNIX)
    stale.bind(str(d.socket))  # a socket file nobody listens on, as after a SIGKILL
    stale.close()
    d.start()
    d.client("y").save(1, {}).wait("local")
    assert [c.step for c in d.client("y").list()] == [1]


def test_sigkilled_daemon_restarts_on_its_socket(daemon: Daemon) -> None:
    daemon.kill()
    assert daemon.socket.exists()  # left behind
    daemon.restart()
    daemon.client("z").list()
