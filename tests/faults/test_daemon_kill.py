"""The daemon SIGKILLed at named points of every path; then the invariants must hold.

Each case arms one failpoint with ``pause``, drives the daemon there, kills it
while it is stopped at that point, restarts it with nothing armed and checks
the shared invariants (invariants.py): every acknowledged save is committed,
nothing partial is visible, the newest step restores bit-exact, nothing leaks.
Trainers keep their client across the crash: a save or restore that was in
flight must complete on the restarted daemon without the test retrying it.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client.handle import SaveHandle
from ckptd.daemon.remote import index
from ckptd.proto import ckptd_pb2 as pb

from ..conftest import Daemon
from ..helpers import state_for
from .invariants import Ledger, check_all, proc_counts

MIB = 2
FAST_DRAIN = ["--drain-retry-max-seconds", "1", "--retention-local", "KeepLatest(10)"]


def _state(step: int) -> dict[str, np.ndarray]:
    return state_for(step, MIB)


class Background:
    """Runs ``fn`` on a thread; :meth:`result` joins and re-raises its error."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._out: list[Any] = []
        self._err: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._out.append(fn())
        except BaseException as exc:
            self._err.append(exc)

    def result(self, timeout: float = 180.0) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the call did not finish after the restart"
        if self._err:
            raise self._err.pop()
        return self._out.pop()  # not kept: restored arrays hold their segment


def _crash_at(daemon: Daemon, point: str) -> None:
    """Wait until the daemon is stopped at ``point``, SIGKILL it, restart it clean."""
    daemon.wait_failpoint(point)
    daemon.kill()
    daemon.env = {}
    daemon.restart()


def _remote(tmp_path: Path) -> str:
    return f"file://{tmp_path}/bucket"


SAVE_POINTS = [
    "journal.write",  # the handoff arrived; its record is not on disk: not acknowledged
    "journal.synced",  # on disk, the answer not sent: acknowledged or not, never twice
    "write.begin",
    "write.mid",
    "commit.before_rename",
    "commit.after_rename",
    "journal.done",  # committed, its leases not yet retired
]
REPRESENTATIVE = {"journal.synced", "write.begin", "drain.part", "fetch.part"}


def _mark(points: list[str]) -> list[Any]:
    return [
        pytest.param(p, marks=() if p in REPRESENTATIVE else pytest.mark.faults, id=p)
        for p in points
    ]


@pytest.mark.parametrize("point", _mark(SAVE_POINTS))
def test_killed_on_the_save_path(make_daemon: Any, point: str) -> None:
    daemon: Daemon = make_daemon(extra_args=FAST_DRAIN)
    client = daemon.client("save")
    # write.mid is between two write chunks: only a state larger than one has it.
    ledger = Ledger("save", lambda s: state_for(s, 72 if point == "write.mid" else MIB))
    ledger.save(client, 1).wait("local")
    daemon.stop()
    daemon.env = {"CKPTD_FAILPOINTS": f"{point}=pause"}
    daemon.restart()
    # In flight on the trainer's own thread: it must ride out the crash by itself.
    saving = Background(lambda: ledger.save(client, 2))
    _crash_at(daemon, point)
    saving.result()
    assert daemon.proc is not None
    baseline = proc_counts(daemon.proc.pid)
    ledger.save(client, 3)
    outcome = check_all(daemon, client, ledger, baseline=baseline)
    assert outcome == {1: "LOCAL", 2: "LOCAL", 3: "LOCAL"}
    # Exactly one copy of step 2, and its events show one commit.
    assert [c.step for c in client.list()] == [3, 2, 1]


def test_killed_holding_a_granted_lease_and_mid_copy(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon()
    client = daemon.client("copy")
    ledger = Ledger("copy", _state)
    copying, go_on = threading.Event(), threading.Event()
    original = client._saver.copy_arrays

    def slow_copy(mm: Any, entries: Any, arrays: Any) -> None:
        original(mm, entries[:1], arrays)  # half the state is in the lease
        copying.set()
        go_on.wait(60)
        original(mm, entries[1:], arrays)

    client._saver.copy_arrays = slow_copy  # type: ignore[method-assign]
    saving = Background(lambda: ledger.save(client, 1))
    assert copying.wait(60)
    daemon.kill()  # the lease is granted, the bytes half copied, nothing committed
    daemon.restart()
    go_on.set()
    saving.result()  # committed on the new daemon from the copy this process kept
    client._saver.copy_arrays = original  # type: ignore[method-assign]
    check_all(daemon, client, ledger)


def test_killed_with_one_rank_of_two_handed_off(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=pause"})
    ranks = [daemon.client("pair", rank=r, node_ranks=[0, 1]) for r in (0, 1)]
    ranks[0].save(5, {"r0": np.arange(100)}, metadata={"step": 5})
    daemon.wait_failpoint("write.begin")
    daemon.kill()
    daemon.env = {}
    daemon.restart()
    # The journal restores rank 0's handoff; rank 1 commits after the restart.
    ranks[1].save(5, {"r1": np.arange(200)}, metadata={"step": 5})
    SaveHandle(ranks[0], 5).wait("local", timeout=120)
    tree, _ = ranks[1].restore(step=5)
    np.testing.assert_array_equal(tree["r1"], np.arange(200))


def test_step_missing_a_rank_fails_after_step_timeout(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon(extra_args=["--step-timeout-seconds", "1"])
    rank0 = daemon.client("half", rank=0, node_ranks=[0, 1])
    handle = rank0.save(1, {"x": np.arange(10)})
    event = daemon.wait_event(lambda e: e.kind == pb.STEP_EVENT_FAILED and e.step == 1)
    assert "ranks [1]" in event.detail and "step_timeout_seconds" in event.detail
    with pytest.raises(Exception, match="never handed off"):
        handle.wait("local", timeout=30)
    assert daemon.status().leases_held == 0  # its memory came back with the failure


DRAIN_POINTS = ["drain.upload", "drain.part", "drain.file", "drain.before_marker"]


@pytest.mark.parametrize("point", _mark(DRAIN_POINTS))
def test_killed_on_the_drain_path(make_daemon: Any, tmp_path: Path, point: str) -> None:
    url = _remote(tmp_path)
    daemon: Daemon = make_daemon(
        env={"CKPTD_FAILPOINTS": f"{point}=pause"}, extra_args=["--remote", url, *FAST_DRAIN]
    )
    client = daemon.client("drain")
    ledger = Ledger("drain", _state)
    ledger.save(client, 1).wait("local")
    _crash_at(daemon, point)
    SaveHandle(client, 1).wait("durable", timeout=120)  # queued again at start-up
    check_all(daemon, client, ledger, remote_url=url)


@pytest.mark.faults
def test_killed_while_evicting(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon(
        env={"CKPTD_FAILPOINTS": "evict.begin=pause"},
        extra_args=["--retention-local", "KeepLatest(1)"],
    )
    client = daemon.client("evict")
    ledger = Ledger("evict", _state, evictable={1})
    ledger.save(client, 1).wait("local")
    ledger.save(client, 2).wait("local")
    _crash_at(daemon, "evict.begin")
    outcome = check_all(daemon, client, ledger)
    assert outcome[2] == "LOCAL"
    assert [c.step for c in client.list() if c.step != 0] == [2]  # the eviction finished


@pytest.mark.faults
def test_killed_evicting_from_the_bucket_between_marker_and_index(
    make_daemon: Any, tmp_path: Path
) -> None:
    """Killed after deleting step 1's marker, before taking it out of the node's
    index: the restarted daemon reads the index, still naming step 1 (flagged as
    being removed: never listed), and its drain finishes the eviction (before, the
    index went first and such a crash left a complete step in the bucket that no
    node would ever evict)."""
    url = _remote(tmp_path)
    daemon: Daemon = make_daemon(
        env={"CKPTD_FAILPOINTS": "evict.remote_marker_gone=pause"},
        extra_args=["--remote", url, *FAST_DRAIN, "--retention-remote", "KeepLatest(1)"],
    )
    client = daemon.client("gone")
    ledger = Ledger("gone", _state, evictable={1})
    ledger.save(client, 1).wait("durable", 60)
    ledger.save(client, 2).wait("durable", 60)
    _crash_at(daemon, "evict.remote_marker_gone")
    # Never listed again, before or after the eviction is finished (its copy is going).
    assert [c.step for c in client.list() if "REMOTE" in c.tiers] == [2]
    bucket = tmp_path / "bucket" / "gone"

    def step_1_objects() -> list[Path]:  # gone/1/... and gone/_data/<hh>/<node>/1.0/...
        return [f for f in [*bucket.glob("1/**/*"), *bucket.glob("_data/*/*/1.0/*")] if f.is_file()]

    # The restarted evictor counts the eviction only once the index entry, the last
    # thing it removes, is gone: wait on that (the objects go first, so their absence
    # alone raced the index write under load).
    deadline = time.monotonic() + 60
    while daemon.status().evicted_remote < 1:
        assert time.monotonic() < deadline, step_1_objects()
        time.sleep(0.1)
    assert step_1_objects() == []
    raw = (bucket / "_index" / "test-node.json").read_bytes()
    assert sorted(index.decode(raw)) == [2]
    assert [c.step for c in client.list() if "REMOTE" in c.tiers] == [2]
    check_all(daemon, client, ledger, remote_url=url)


RESTORE_POINTS = ["fetch.part", "commit.before_rename", "commit.after_rename"]


@pytest.mark.parametrize("point", _mark(RESTORE_POINTS))
def test_killed_restoring_from_the_bucket(make_daemon: Any, tmp_path: Path, point: str) -> None:
    url = _remote(tmp_path)
    daemon: Daemon = make_daemon(extra_args=["--remote", url, *FAST_DRAIN])
    client = daemon.client("fetch")
    ledger = Ledger("fetch", _state)
    for step in (1, 2):
        ledger.save(client, step).wait("durable", timeout=120)
    daemon.stop()
    shutil.rmtree(daemon.root / "fetch")  # the node lost its local tier
    daemon.env = {"CKPTD_FAILPOINTS": f"{point}=pause"}
    daemon.restart()
    restoring = Background(lambda: client.restore())
    _crash_at(daemon, point)
    tree, meta = restoring.result()  # the trainer's restore rides out the crash
    same = tree["w0"].tobytes() == _state(2)["w0"].tobytes()
    del tree  # before any assert: pytest's rewriting may keep what an assert touched
    assert meta == {"step": 2} and same
    check_all(daemon, client, ledger, remote_url=url)


@pytest.mark.faults
def test_killed_reading_a_restore_into_shared_memory(make_daemon: Any) -> None:
    # The memory tier off: the restore must read the disk (the memory tier's own
    # crash cases are tests/test_memory_tier.py's).
    daemon: Daemon = make_daemon(extra_args=["--memory-tier-steps", "0"])
    client = daemon.client("read")
    ledger = Ledger("read", _state)
    ledger.save(client, 1).wait("local")
    daemon.stop()
    daemon.env = {"CKPTD_FAILPOINTS": "restore.read=pause"}
    daemon.restart()
    ledger.save(client, 2).wait("local")  # a free segment to restore into
    restoring = Background(lambda: client.restore())
    _crash_at(daemon, "restore.read")
    tree, meta = restoring.result()
    same = tree["w1"].tobytes() == _state(2)["w1"].tobytes()
    del tree
    assert meta == {"step": 2} and same
    check_all(daemon, client, ledger)


def test_sigterm_after_a_failed_download_exits_cleanly(make_daemon: Any, tmp_path: Path) -> None:
    url = _remote(tmp_path)
    daemon: Daemon = make_daemon(extra_args=["--remote", url, *FAST_DRAIN])
    client = daemon.client("bad")
    client.save(1, state_for(1, 8), metadata={"step": 1}).wait("durable", timeout=120)
    daemon.stop()
    shutil.rmtree(daemon.root / "bad")
    # Corrupt the only copy in the bucket: its download fails its checksum.
    rank_file = next((tmp_path / "bucket").rglob("rank-00000.safetensors"))
    raw = bytearray(rank_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    rank_file.write_bytes(bytes(raw))
    daemon.restart()
    other = daemon.client("other")
    with pytest.raises(Exception, match=r"(?i)corrupt|does not verify|no restorable"):
        client.restore()
    # Another job's save right after is untouched by the failed download.
    other.save(1, state_for(7, 8), metadata={"step": 1}).wait("local")
    tree, _ = other.restore()
    same = tree["w2"].tobytes() == state_for(7, 8)["w2"].tobytes()
    del tree
    assert same
    assert daemon.stop() == 0  # SIGTERM: clean exit, nothing leaked
    prefix_left = list(Path("/dev/shm").glob(f"{_prefix(daemon)}*"))
    assert prefix_left == []
    from ckptd.daemon.local.staging import recorded_dir

    seg_dir = recorded_dir(daemon.root)
    assert seg_dir is not None and not seg_dir.exists()  # its directory goes too


def _prefix(daemon: Daemon) -> str:
    from ckptd.daemon.local.staging import segment_prefix

    return segment_prefix(daemon.root)
