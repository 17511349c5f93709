"""Crash rules: acknowledged saves survive the trainer; a killed daemon leaves nothing partial."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client import SaveFailed
from ckptd.client.handle import SaveHandle

from .conftest import Daemon
from .helpers import state_for

TRAINER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from helpers import state_for
    from ckptd.client import Client
    c = Client("killed", socket={socket!r})
    c.save(7, state_for(7, {mib}), metadata={{"step": 7}})
    print("ACK", flush=True)
    time.sleep(600)
""")


def test_trainer_sigkilled_after_save_returns_still_commits(make_daemon: Any) -> None:
    # The daemon holds the write back until the trainer is dead.
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=pause"})
    script = TRAINER.format(tests=str(Path(__file__).parent), socket=str(daemon.socket), mib=32)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert trainer.stdout is not None
    assert trainer.stdout.readline().strip() == "ACK"
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait(10)
    daemon.wait_failpoint("write.begin")
    client = daemon.client("killed")
    assert client.list()[0].state == "STAGING"  # acknowledged, not yet written
    daemon.release("write.begin")
    SaveHandle(client, 7).wait("local", timeout=60)
    tree, meta = client.restore()
    assert meta == {"step": 7}
    for k, v in state_for(7, 32).items():
        assert tree[k].tobytes() == v.tobytes()


@pytest.mark.parametrize("failpoint", ["write.mid", "commit.before_rename"])
def test_daemon_sigkilled_mid_save_leaves_no_partial_step(make_daemon: Any, failpoint: str) -> None:
    daemon: Daemon = make_daemon()
    daemon.client("crashy").save(1, {"x": np.arange(1000)}).wait("local")
    # Armed only now, so step 2 is the save that stops there.
    daemon.stop()
    daemon.env = {"CKPTD_FAILPOINTS": f"{failpoint}=pause"}
    daemon.restart()
    client = daemon.client("crashy")
    segments_before = {p.name for p in Path("/dev/shm").glob("ckptd-*")}
    client.save(2, state_for(2, 96))  # 96 MiB: more than one 64 MiB write chunk
    staging = daemon.root / ".staging"
    daemon.wait_failpoint(failpoint)
    leftovers = list(staging.rglob("*"))
    assert leftovers, "the save should be in progress in .staging"
    daemon.kill()
    assert not (daemon.root / "crashy" / "2").exists()
    ours = {p.name for p in Path("/dev/shm").glob("ckptd-*")} - segments_before
    daemon.env = {}
    daemon.restart()
    client = daemon.client("crashy")
    assert [c.step for c in client.list()] == [1]
    assert list(staging.iterdir()) == []
    assert not any((Path("/dev/shm") / name).exists() for name in ours)
    tree, _ = client.restore()
    np.testing.assert_array_equal(tree["x"], np.arange(1000))
    # and the daemon takes step 2 again normally
    client.save(2, state_for(2, 8)).wait("local")
    assert [c.step for c in client.list()] == [2, 1]


def test_sigterm_finishes_acknowledged_saves_before_exit(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=pause"})
    client = daemon.client("term")
    client.save(4, state_for(4, 8), metadata={"ok": True})
    daemon.wait_failpoint("write.begin")
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)  # while the acknowledged save is not written
    daemon.release("write.begin")
    assert daemon.stop() == 0
    assert (daemon.root / "term" / "4" / "manifest.json").exists()
    assert not daemon.socket.exists()
    daemon.env = {}
    daemon.restart()
    tree, meta = daemon.client("term").restore()
    assert meta == {"ok": True}
    assert tree["w0"].tobytes() == state_for(4, 8)["w0"].tobytes()


def test_failed_write_is_reported_and_the_step_can_be_retried(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=enospc_once"})
    client = daemon.client("full")
    h = client.save(1, {"x": np.arange(20)})
    with pytest.raises(SaveFailed, match="No space left on device"):
        h.wait("local", timeout=30)
    rows = client.list()
    assert [(r.step, r.state) for r in rows] == [(1, "FAILED")]
    assert "No space left" in rows[0].error
    assert list((daemon.root / ".staging").iterdir()) == []  # nothing partial left
    client.save(1, {"x": np.arange(30)}).wait("local")  # the same step, retried
    client.save(2, {"x": np.arange(40)}).wait("local")
    assert [(r.step, r.state) for r in client.list()] == [(2, "LOCAL"), (1, "LOCAL")]
    tree, _ = client.restore(step=1)
    np.testing.assert_array_equal(tree["x"], np.arange(30))
