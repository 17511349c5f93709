"""The operator's command line (issue 16): pull and verify find the running daemon's
root and bucket, verify refuses to pass when it checked nothing, ``ls`` suggests a
job name, ``status --watch`` shows exposure and the drain, and a restore from the
bucket reports its progress by bytes (per part, not per file)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client import Client, TreeMismatch

from .conftest import CKPTD, Daemon, RemoteTarget
from .helpers import state_for
from .test_remote_tier import remote_daemon


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The ckptd command with no CKPTD_* setting in its environment (unless given)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    return subprocess.run(
        [CKPTD, *args], capture_output=True, text=True, timeout=300, env={**clean, **(env or {})}
    )


@pytest.fixture
def bucket_daemon(make_daemon: Any, tmp_path: Path) -> tuple[Daemon, RemoteTarget]:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    return remote_daemon(make_daemon, remote), remote


def test_pull_and_verify_use_the_running_daemons_root_and_bucket(
    bucket_daemon: tuple[Daemon, RemoteTarget], tmp_path: Path
) -> None:
    daemon, _ = bucket_daemon
    state = state_for(3, 2)
    daemon.client("ops").save(5, state).wait("durable", 120)
    sock = str(daemon.socket)
    out = run("verify", "--socket", sock)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"using the running daemon's root {daemon.root}" in out.stderr
    assert "2 copies checked, 0 corrupt" in out.stdout  # the local copy and the bucket's
    rows = [line.split() for line in out.stdout.splitlines()]
    assert ["OK", "local", "ops/5"] in rows and ["OK", "remote", "ops/5/test-node"] in rows
    dest = tmp_path / "pulled"
    out = run("pull", "ops", str(dest), "--socket", sock)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (dest / "manifest.json").exists() and "crc32c verified" in out.stdout
    # Progress ends with a line saying every byte arrived (plain, as stderr is a pipe).
    assert "ops/5/test-node: 2.0 MiB of 2.0 MiB (100%)" in out.stderr
    # A flag wins over the daemon: an empty root and no bucket is nothing to check.
    empty = tmp_path / "empty"
    empty.mkdir()
    out = run("verify", "--root", str(empty), "--local-only", "--socket", sock)
    assert out.returncode == 3 and "nothing to verify" in out.stderr, out
    assert "Traceback" not in out.stderr
    # No daemon and nothing configured: the defaults hold nothing here; said, not passed.
    out = run("verify", "--socket", str(tmp_path / "none.sock"), env={"CKPTD_ROOT": str(empty)})
    assert out.returncode == 3 and "nothing to verify" in out.stderr, out


def test_ls_suggests_a_job_name(daemon: Daemon) -> None:
    daemon.client("pretrain-7b").save(1, {"w": np.ones(4)}).wait("local")
    out = run("ls", "pretrian-7b", "--socket", str(daemon.socket))
    assert out.returncode == 0 and "no checkpoints for job 'pretrian-7b'" in out.stdout
    assert "did you mean 'pretrain-7b'?" in out.stderr
    out = run("ls", "zzz", "--socket", str(daemon.socket))
    assert "jobs on this daemon: pretrain-7b" in out.stderr


def test_status_watch_shows_exposure_and_the_drain(
    bucket_daemon: tuple[Daemon, RemoteTarget],
) -> None:
    daemon, _ = bucket_daemon
    daemon.client("watched").save(1, {"w": np.ones(1024)}).wait("durable", 120)
    out = run(
        "status", "--watch", "--count", "2", "--interval", "0.05", "--socket", str(daemon.socket)
    )
    assert out.returncode == 0, out.stderr
    frames = out.stdout.split("\n\n")
    assert len(frames) >= 2 and out.stdout.count("EXPOSURE LOCAL") == 2
    row = next(line.split() for line in frames[0].splitlines() if line.startswith("watched"))
    assert row[0] == "watched" and row[2] == "s" and row[4] == "s"  # seconds, both tiers
    assert "0 steps queued" in out.stdout and "upload 0 B/s" in out.stdout
    assert "staging" in out.stdout and "local free" in out.stdout


def test_restore_from_the_bucket_reports_progress_by_bytes(
    make_daemon: Any, tmp_path: Path
) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon = remote_daemon(make_daemon, remote)
    state = state_for(7, 24)  # 24 MiB in one rank file: five 5 MiB parts
    daemon.client("far").save(2, state).wait("durable", 120)
    daemon.stop()
    shutil.rmtree(daemon.root)
    daemon.env["CKPTD_FAILPOINTS"] = "fetch.part=pause"
    daemon.restart()
    got: dict[str, Any] = {}
    client = daemon.client("far")
    t = threading.Thread(target=lambda: got.update(tree=client.restore()[0]))
    t.start()
    try:
        daemon.wait_failpoint("fetch.part")
        # One part waits at the failpoint; the status says how much is under way. Other
        # parts may land meanwhile: done is counted per part, whole parts of 5 MiB and
        # perhaps the file's shorter last one.
        st = daemon.status()
        size = st.fetch_in_flight_bytes
        assert size > 24 * 2**20 and st.fetch_done_bytes < size
        assert st.fetch_done_bytes % (5 * 2**20) in (0, size % (5 * 2**20))
        out = run("status", "--socket", str(daemon.socket))
        assert "bucket fetches" in out.stdout and "MiB of" in out.stdout
    finally:
        daemon.release("fetch.part")
        t.join(120)
    assert all(got["tree"][k].tobytes() == v.tobytes() for k, v in state.items())
    st = daemon.status()
    assert st.fetch_in_flight_bytes == 0 and st.fetch_done_bytes == 0


def test_client_steps_wait_and_numpy_target_dtype(daemon: Daemon) -> None:
    c: Client = daemon.client("conv")
    assert c.all_steps() == [] and c.latest_step() is None
    c.wait_until_finished()  # no save yet: returns at once
    for step in (1, 3, 2):
        c.save(step, {"w": np.full(8, step, np.float32)})
    c.wait_until_finished()
    # Step 2, saved after 3, began a new timeline: 3 is abandoned, 2 the newest.
    assert c.all_steps() == [1, 2] and c.latest_step() == 2
    with pytest.raises(TreeMismatch, match=r"target has dtype float64 and the checkpoint float32"):
        c.restore(target={"w": np.zeros(8, np.float64)})


def test_io_threads_yield_to_the_trainer(make_daemon: Any) -> None:
    """The write, read and checksum threads run at ``io_nice`` (default 10); the rest
    of the daemon (its event loop, which answers save() handoffs) does not."""
    daemon = make_daemon()
    daemon.client("nice").save(1, {"w": np.ones(1 << 20)}).wait("local")
    assert daemon.proc is not None
    tasks = Path(f"/proc/{daemon.proc.pid}/task")
    nice = [
        int(t.joinpath("stat").read_text().rsplit(")", 1)[1].split()[16]) for t in tasks.iterdir()
    ]
    assert nice.count(10) >= 5  # 4 + 2 I/O threads and the checksum thread
    assert nice[0] == 0 or 0 in nice  # the main thread keeps the process's priority
    out = run("serve", "--io-nice", "25", "--root", "/tmp/x", "--socket", "/tmp/x.sock")
    assert out.returncode == 2 and "invalid value for 'io_nice': 25" in out.stderr


def test_every_option_of_every_command_says_what_it_is() -> None:
    import argparse

    from ckptd.daemon.app.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"{name} {action.dest}"
        for name, p in sub.choices.items()
        for action in p._actions
        if not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert missing == [], missing
