"""Crash rules: acknowledged saves survive the trainer; a killed daemon leaves nothing partial."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client import SaveFailed
from ckptd.client.handle import SaveHandle
from ckptd.daemon.local.staging import KEPT_SUFFIX, recorded_dir

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


def _segments_accounted(daemon: Daemon) -> None:
    """No lease left behind, and every segment of this root in /dev/shm is one the
    daemon holds (none leaked). Call with no restored arrays alive."""
    gc.collect()  # restored arrays hold their segment until collected
    daemon.client("probe").save(0, {"p": np.zeros(4)}).wait("local")  # takes back returns
    assert daemon.status().leases_held == 0
    seg_dir = recorded_dir(daemon.root)
    assert seg_dir is not None
    # A spare segment being made in the background (local/spares.py) counts as
    # allocated before its file is whole: the two agree once it is made.
    deadline = time.monotonic() + 60
    while True:
        # The memory tier's records (<segment>.kept) are not segments: each names one.
        on_disk = sum(p.stat().st_size for p in seg_dir.iterdir() if p.suffix != KEPT_SUFFIX)
        allocated = daemon.status().staging_allocated_bytes
        if on_disk == allocated or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # polling the daemon's status, not waiting for it
    assert on_disk == allocated


@pytest.mark.parametrize("failpoint", ["write.begin", "write.mid", "commit.before_rename"])
def test_acknowledged_save_survives_daemon_sigkill(make_daemon: Any, failpoint: str) -> None:
    daemon: Daemon = make_daemon()
    daemon.client("crashy").save(1, {"x": np.arange(1000)}).wait("local")
    # Armed only now, so step 2 is the save that stops there.
    daemon.stop()
    daemon.env = {"CKPTD_FAILPOINTS": f"{failpoint}=pause"}
    daemon.restart()
    client = daemon.client("crashy")
    client.save(2, state_for(2, 96), metadata={"s": 2})  # 96 MiB: more than one write chunk
    daemon.wait_failpoint(failpoint)
    daemon.kill()  # after the acknowledgement, before LOCAL
    assert not (daemon.root / "crashy" / "2").exists()  # nothing partial is visible
    daemon.env = {}
    daemon.restart()
    # The journal's record is replayed: the handle resolves on the new daemon.
    SaveHandle(client, 2).wait("local", timeout=120)
    assert list((daemon.root / ".staging").iterdir()) == []
    tree, meta = client.restore()
    assert meta == {"s": 2}
    for k, v in state_for(2, 96).items():
        assert tree[k].tobytes() == v.tobytes(), k
    del tree
    _segments_accounted(daemon)
    client.save(3, state_for(3, 8)).wait("local")
    assert [c.step for c in client.list()][:2] == [3, 2]


def test_saves_that_never_waited_all_survive_a_crash(make_daemon: Any) -> None:
    # Writes are held back, so every save below is acknowledged but not LOCAL.
    daemon: Daemon = make_daemon(
        env={"CKPTD_FAILPOINTS": "write.begin=pause"},
        extra_args=["--retention-local", "KeepLatest(100)"],
    )
    # Every save written: none may take another's place (test_supersede.py has that).
    client = daemon.client("loop", supersede=False)
    for step in range(1, 9):
        client.save(step, state_for(step, 1), metadata={"s": step})
    daemon.wait_failpoint("write.begin")
    daemon.kill()
    daemon.env = {}
    daemon.restart()
    for step in range(1, 9):
        SaveHandle(client, step).wait("local", timeout=120)
        tree, meta = client.restore(step=step)
        assert meta == {"s": step}
        assert tree["w0"].tobytes() == state_for(step, 1)["w0"].tobytes()
    del tree
    _segments_accounted(daemon)


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
