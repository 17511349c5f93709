"""A save's commit goes to the daemon while the client still copies its bytes.

The daemon journals and answers at once, and reads the lease only once the
client's word says it is whole (daemon/local/copied.py). These tests hold the
client's copy at the point that matters, through the real client and a real
daemon: the write waits for the word; a client gone before its word, or whose
copy failed, loses that save (its save() never returned) and its memory comes
back; a daemon killed while waiting replays the save once the word comes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client import Client
from ckptd.client.handoff import Handoff, Liveness
from ckptd.core.errors import CkptdError
from ckptd.core.wire import Connection
from ckptd.daemon.local.liveness import process_running, process_start
from ckptd.proto import ckptd_pb2 as pb

from .conftest import Daemon
from .helpers import state_for

WAIT = "copied.wait"
"""The daemon's failpoint: the commit journaled and answered, the lease not yet read."""


def _held_copy(client: Client, during: Callable[[], None]) -> None:
    """Run ``during()`` inside the client's next copy, before any byte is copied."""
    original = client._saver.copy_arrays

    def copy(mm: Any, entries: Any, arrays: Any) -> None:
        client._saver.copy_arrays = original  # type: ignore[method-assign]
        during()
        original(mm, entries, arrays)

    client._saver.copy_arrays = copy  # type: ignore[method-assign]


def _status(daemon: Daemon, job: str, step: int, timeout: float = 0.0) -> pb.SaveStatus:
    """The save's state, waiting up to ``timeout`` s for LOCAL (or its end)."""
    req = pb.GetSaveStatusRequest(
        job=job, step=step, wait_for=pb.SAVE_STATE_LOCAL, timeout_seconds=timeout
    )
    status: pb.SaveStatus = daemon.connection.get_save_status(req, timeout + 60)
    return status


def _ended(daemon: Daemon, job: str, step: int) -> pb.SaveStatus:
    status = _status(daemon, job, step, timeout=60)
    assert status.final or status.reached, "the save neither ended nor went LOCAL"
    return status


def _assert_restores(client: Client, step: int, state: dict[str, np.ndarray]) -> None:
    tree, _ = client.restore(step=step)
    for key, value in state.items():
        np.testing.assert_array_equal(tree[key], value)


def test_the_write_waits_for_the_word(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": f"{WAIT}=pause"})
    client = daemon.client("word")
    state = state_for(1, 2)

    def during() -> None:
        daemon.wait_failpoint(WAIT)  # journaled and answered before a byte was copied
        daemon.release(WAIT)
        # Nothing is in the lease yet: a write that did not wait would commit it now.
        status = _status(daemon, "word", 1, timeout=1.0)
        assert status.state == pb.SAVE_STATE_STAGING and not status.reached

    _held_copy(client, during)
    client.save(1, state).wait("local", timeout=60)
    _assert_restores(client, 1, state)


def test_a_failed_copy_fails_the_save_at_once(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": f"{WAIT}=pause"})
    client = daemon.client("broken")

    def during() -> None:
        daemon.wait_failpoint(WAIT)
        daemon.release(WAIT)
        raise ValueError("a device copy failed")

    _held_copy(client, during)
    with pytest.raises(ValueError, match="device copy failed"):
        client.save(1, state_for(1, 2))
    status = _ended(daemon, "broken", 1)
    assert status.state == pb.SAVE_STATE_FAILED and "copy into shared memory failed" in status.error
    assert daemon.status().leases_held == 0
    client.save(2, state_for(2, 2)).wait("local", timeout=60)
    _assert_restores(client, 2, state_for(2, 2))


def test_a_daemon_killed_waiting_for_the_word_replays_the_save_once_written(
    make_daemon: Any,
) -> None:
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": f"{WAIT}=pause"})
    client = daemon.client("replay")
    state = state_for(1, 2)

    def during() -> None:
        daemon.wait_failpoint(WAIT)  # journaled; the lease not yet read
        daemon.kill()
        daemon.env = {}
        daemon.restart()  # the replay adopts the segment this process still maps

    _held_copy(client, during)
    client.save(1, state).wait("local", timeout=60)
    assert [c.step for c in client.list()] == [1]
    _assert_restores(client, 1, state)


def _commit(daemon: Daemon, holder: bool, copied_at: int | None) -> str:
    """A one-shard commit sent while copying, ``copied_at`` past the data (None: right
    past it), on a lease asked for with or without a liveness header; the refusal."""
    live = Liveness()
    try:
        with Connection(daemon.socket, timeout=30) as conn:
            meta = live.metadata() if holder else ()
            lease = conn.acquire_lease(
                pb.AcquireLeaseRequest(job="bad", size_bytes=4096 + 8), 30, meta
            )
            shard = pb.ShardDescriptor(key="a", dtype="<f4", shape=[4], offset=0, length=16)
            req = pb.CommitShardsRequest(
                lease_id=lease.lease_id,
                job="bad",
                step=1,
                shards=[shard],
                copied_nonce=12345,
                copied_at=4096 if copied_at is None else copied_at,
            )
            try:
                conn.commit_shards(req)
            except CkptdError as exc:
                return f"{exc.code}: {exc}"
            return "OK"
    finally:
        live.close()


@pytest.mark.parametrize(
    ("holder", "copied_at", "says"),
    [
        (True, 8, "must be a multiple of 8 from byte 4096"),  # inside the data
        (True, 4100, "must be a multiple of 8"),
        (True, 2**40, "within the lease"),
        (False, None, "liveness header"),
    ],
)
def test_a_word_with_no_place_or_no_one_to_wait_for_is_refused(
    daemon: Daemon, holder: bool, copied_at: int | None, says: str
) -> None:
    refusal = _commit(daemon, holder, copied_at)
    assert refusal.startswith("INVALID_ARGUMENT") and says in refusal, refusal
    assert daemon.status().leases_held <= 1  # the lease is still the client's, nothing else


class _Recorder(Handoff):
    """A handoff whose commit only records what it was sent and what the lease held."""

    def __init__(self) -> None:  # no connection: commit() below never calls the daemon
        self.sent: list[tuple[pb.CommitShardsRequest, bytes]] = []

    def commit(self, req: Any, mm: Any, size: int, what: str, copied: Any = None) -> None:
        self.sent.append((req, bytes(mm[:size])))


@pytest.mark.parametrize(
    ("word", "room", "deferred"),
    [(True, 8, True), (False, 8, False), (True, 7, False)],
    ids=["daemon-waits", "older-daemon", "no-room"],
)
def test_the_commit_goes_out_while_copying_only_to_a_daemon_that_waits_with_room(
    word: bool, room: int, deferred: bool
) -> None:
    handoff, mm = _Recorder(), mmap.mmap(-1, 4096 + room)
    copied: list[bool] = []
    with ThreadPoolExecutor(1) as committer:
        handoff.commit_copying(
            pb.CommitShardsRequest(step=3),
            mm,
            4096,
            "step 3",
            lambda: copied.append(bool(handoff.sent)),  # was the commit out before?
            committer,
            word,
        )
    ((req, held),) = handoff.sent
    if deferred:
        assert req.copied_at == 4096 and req.copied_nonce
        assert int.from_bytes(mm[4096:4104], "little") == req.copied_nonce
    else:
        assert copied == [False] and not req.copied_nonce  # copied, then committed
        assert len(held) == 4096 and not any(mm[4096:])


def test_a_copy_that_fails_leaves_the_failed_word_and_raises() -> None:
    handoff, mm = _Recorder(), mmap.mmap(-1, 4096 + 8)

    def copy() -> None:
        raise OSError("device gone")

    with ThreadPoolExecutor(1) as committer, pytest.raises(OSError, match="device gone"):
        handoff.commit_copying(pb.CommitShardsRequest(), mm, 4096, "s", copy, committer)
    ((req, _),) = handoff.sent
    assert int.from_bytes(mm[4096:4104], "little") == req.copied_nonce ^ ((1 << 64) - 1)


CHILD = """
import os, sys, threading, numpy as np
from ckptd.client import Client
socket, marker, job, fork = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "fork"
client = Client(job, socket=socket)
def copy(mm, entries, arrays):
    child = os.fork() if fork else -1  # it inherits the liveness file's lock
    if child == 0:
        threading.Event().wait(120)
        os._exit(0)
    with open(marker + ".tmp", "w") as f:
        f.write(str(child))
    os.replace(marker + ".tmp", marker)
    threading.Event().wait()  # the trainer stops here, mid-save, and is killed
client._saver.copy_arrays = copy
client.save(1, {"x": np.arange(1024.0)})
"""


class Trainer:
    """A trainer process whose first save stops mid-copy, its commit sent; ``fork``:
    it forks a process there first, which inherits its liveness file's lock."""

    def __init__(self, daemon: Daemon, job: str, tmp_path: Path, fork: bool = False) -> None:
        self.marker = tmp_path / f"{job}.copying"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
        args = [sys.executable, "-c", CHILD, str(daemon.socket), str(self.marker), job]
        self.proc = subprocess.Popen([*args, "fork" if fork else "plain"], env=env)
        self.forked = 0

    def wait_copying(self) -> None:
        """Until it stands in its copy (it writes the marker file then)."""
        deadline = time.monotonic() + 60
        while not self.marker.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "never copied"
            time.sleep(0.05)
        self.forked = max(0, int(self.marker.read_text()))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def close(self) -> None:
        self.kill()
        if self.forked:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.forked, signal.SIGKILL)


def test_a_client_gone_before_its_word_loses_only_that_save(
    make_daemon: Any, tmp_path: Path
) -> None:
    daemon: Daemon = make_daemon()
    client = daemon.client("gone")
    client.save(0, state_for(0, 2)).wait("local", timeout=60)
    daemon.stop()
    daemon.env = {"CKPTD_FAILPOINTS": f"{WAIT}=pause"}
    daemon.restart()
    trainer = Trainer(daemon, "gone", tmp_path)
    try:
        daemon.wait_failpoint(WAIT)  # journaled, answered; the trainer copies
        daemon.release(WAIT)
        trainer.wait_copying()
        trainer.kill()
        status = _ended(daemon, "gone", 1)
        assert status.state == pb.SAVE_STATE_FAILED, status
        assert "exited before its copy" in status.error
        assert daemon.status().leases_held == 0  # its memory came back before FAILED
    finally:
        trainer.close()
    daemon.stop()  # nothing of it is replayed: its journal record was retired
    daemon.env = {}
    daemon.restart()
    assert [(c.step, c.state) for c in client.list()] == [(0, "LOCAL")]
    client.save(2, state_for(2, 2)).wait("local", timeout=60)
    _assert_restores(client, 2, state_for(2, 2))


def test_a_client_killed_mid_copy_logs_no_traceback(make_daemon: Any, tmp_path: Path) -> None:
    """A trainer SIGKILLed mid-copy is an everyday failure, not a daemon bug: the
    daemon's log says so without a traceback (the log is the oracle only for that)."""
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": f"{WAIT}=pause"})
    trainer = Trainer(daemon, "killed", tmp_path)
    try:
        daemon.wait_failpoint(WAIT)  # journaled, answered; the trainer copies
        daemon.release(WAIT)
        trainer.wait_copying()
        trainer.kill()
        status = _ended(daemon, "killed", 1)
        assert status.state == pb.SAVE_STATE_FAILED and "exited before" in status.error
        assert daemon.status().leases_held == 0
    finally:
        trainer.close()
    daemon.stop()  # whatever the stop logs about it too
    assert "Traceback" not in daemon.log_text(), daemon.log_tail(80)


def test_a_daemon_killed_and_a_client_gone_meanwhile_fail_the_replayed_save(
    make_daemon: Any, tmp_path: Path
) -> None:
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": f"{WAIT}=pause"})
    trainer = Trainer(daemon, "both", tmp_path)
    try:
        daemon.wait_failpoint(WAIT)  # journaled, answered; the trainer copies
        trainer.wait_copying()
        daemon.kill()
        trainer.kill()
        daemon.env = {}
        daemon.restart()
        status = _ended(daemon, "both", 1)
        assert status.state == pb.SAVE_STATE_FAILED and "exited before" in status.error
        assert daemon.status().leases_held == 0
    finally:
        trainer.close()


def test_a_client_killed_while_a_process_it_forked_holds_its_lock_still_counts_as_gone(
    make_daemon: Any, tmp_path: Path
) -> None:
    """DataLoader workers are forked from the trainer and inherit its liveness file's
    descriptor: the daemon asks whether the trainer's own process lives."""
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": f"{WAIT}=pause"})
    trainer = Trainer(daemon, "forked", tmp_path, fork=True)
    try:
        daemon.wait_failpoint(WAIT)  # journaled, answered; the trainer copies
        daemon.release(WAIT)
        trainer.wait_copying()
        trainer.kill()
        status = _ended(daemon, "forked", 1)  # while the forked process holds the lock
        assert status.state == pb.SAVE_STATE_FAILED and "exited before" in status.error
        assert daemon.status().leases_held == 0
    finally:
        trainer.close()


def test_pending_device_copies_are_all_waited_for_even_after_one_failed() -> None:
    """No queued device-to-host copy may still write into a lease given up."""
    from ckptd.client.leaves.torch_device import Pending

    synced: list[int] = []

    class Event:
        def __init__(self, n: int, fails: bool) -> None:
            self.n, self.fails = n, fails

        def synchronize(self) -> None:
            synced.append(self.n)
            if self.fails:
                raise RuntimeError(f"copy {self.n} failed")

    pending = Pending(events=[Event(0, True), Event(1, False), Event(2, True)])
    with pytest.raises(RuntimeError, match="copy 0 failed"):
        pending.wait()
    assert synced == [0, 1, 2]


def test_a_process_is_known_gone_by_its_pid_and_start_time() -> None:
    me, started = os.getpid(), process_start(os.getpid())
    assert started is not None and process_running(me, started)
    assert not process_running(me, started + 1)  # a later process under a reused pid
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child_started = process_start(child.pid)
    child.wait()
    assert child_started is None or not process_running(child.pid, child_started)
