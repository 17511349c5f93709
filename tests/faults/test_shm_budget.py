"""Shared memory stays within ``staging_budget_bytes`` whatever dies when, and a
clean stop gives every name back.

Trainers run as processes of their own (trainer.py) and are SIGKILLed in their
saves, one after another; a spare segment is made in the background meanwhile
(local/spares.py, held at its failpoint until the worst moment). The segment
directory is watched through inotify (tests/shm_watch.py), so a segment that
exists only for a moment still counts: the segments in it never hold more than
the budget. After a clean stop, with a trainer still mapping a segment it
restored, no segment is left. A save finished during the stop starts no spare.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptd.daemon.local.spares import FAILPOINT as SPARE
from ckptd.daemon.local.staging import KEPT_SUFFIX, recorded_dir
from ckptd.proto import ckptd_pb2 as pb

from ..conftest import Daemon
from ..helpers import state_for
from ..shm_watch import DirWatch

TRAINER = Path(__file__).with_name("trainer.py")
MIB = 2  # trainer.py's state: 2 MiB of arrays, one 4 MiB segment per save
SEGMENT = 4 * 2**20
BUDGET = 7 * SEGMENT // 2  # room for three segments, not four
TIMEOUT = 60.0


class Trainer:
    """trainer.py for ``job``, stopped at ``point`` (it writes ``marker`` there)."""

    def __init__(self, daemon: Daemon, job: str, point: str, tmp: Path, name: str) -> None:
        self.marker = tmp / f"{name}.marker"
        self.err = tmp / f"{name}.err"
        args = [sys.executable, str(TRAINER), "--socket", str(daemon.socket), "--job", job]
        args += ["--point", point, "--marker", str(self.marker), "--mib", str(MIB)]
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)

    def at_point(self) -> None:
        """Block until the trainer stands at its point."""
        deadline = time.monotonic() + TIMEOUT
        while not self.marker.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"the trainer never reached its point:\n{self.err.read_text()}")
            time.sleep(0.01)

    def kill(self) -> list[str]:
        """SIGKILL it; the protocol lines it printed."""
        os.kill(self.proc.pid, signal.SIGKILL)
        out, _ = self.proc.communicate(timeout=30)
        return out.split()


def wait_status(daemon: Daemon, ok: Callable[[pb.DaemonStatus], bool]) -> pb.DaemonStatus:
    """Poll ``GetStatus`` until ``ok`` holds (bounded)."""
    deadline = time.monotonic() + TIMEOUT
    while not ok(st := daemon.status()):
        assert time.monotonic() < deadline, f"status never got there: {st}"
        time.sleep(0.02)
    return st


def _is_segment(name: str) -> bool:
    return not name.endswith((KEPT_SUFFIX, ".tmp"))


def test_crash_looping_trainers_keep_shared_memory_within_the_budget(
    make_daemon: Any, tmp_path: Path
) -> None:
    d: Daemon = make_daemon(
        extra_args=["--staging-budget-bytes", str(BUDGET)],
        env={"CKPTD_FAILPOINTS": f"{SPARE}=pause"},
    )
    seg_dir = recorded_dir(d.root)
    assert seg_dir is not None
    watch = DirWatch(seg_dir, _is_segment)
    trainers: list[Trainer] = []
    try:
        # Step 0 stays in the memory tier, leaving no free segment: a spare is wanted,
        # and held where it is being made.
        client = d.client("crash")
        client.save(0, state_for(0, MIB), metadata={"step": 0}).wait("local", timeout=TIMEOUT)
        assert [p.stat().st_size for p in seg_dir.iterdir() if _is_segment(p.name)] == [SEGMENT]
        d.wait_failpoint(SPARE)
        # A trainer of the job restores step 0 from memory and holds a save's lease; a
        # trainer of another job takes one more: the budget is spoken for.
        first = Trainer(d, "crash", "after:AcquireLease", tmp_path, "first")
        first.at_point()
        other = Trainer(d, "other", "after:AcquireLease", tmp_path, "other")
        other.at_point()
        trainers += [first, other]
        d.release(SPARE)  # the spare is made now, when the budget has no room for it
        assert "RESTORED" in first.kill()  # it had restored step 0
        other.kill()
        wait_status(d, lambda s: s.leases_held == 0)
        # Five lives of the job, each SIGKILLed in the middle of its save.
        for life in range(5):
            t = Trainer(d, "crash", "mid-copy", tmp_path, f"life{life}")
            trainers.append(t)
            t.at_point()
            t.kill()
            wait_status(d, lambda s: s.leases_held == 0 and s.saves_in_flight == 0)
        st = d.status()
        assert st.staging_allocated_bytes <= BUDGET
        # A live trainer maps a segment it restored (copy-on-write from the memory
        # tier, so the segment stays in the directory) while the daemon stops cleanly.
        client.save(1, state_for(1, MIB), metadata={"step": 1}).wait("local", timeout=TIMEOUT)
        holder = Trainer(d, "crash", "after-restore-holding-arrays", tmp_path, "holder")
        trainers.append(holder)
        holder.at_point()
        assert d.stop() == 0
        assert holder.proc.poll() is None  # it still maps what it restored
    finally:
        for t in trainers:
            if t.proc.poll() is None:
                t.kill()
        watch.stop()
    assert watch.most * SEGMENT <= BUDGET, (
        f"{watch.most} segments of {SEGMENT} bytes were in {seg_dir} at once; the staging "
        f"budget is {BUDGET} bytes (made, in order: {watch.made})"
    )
    left = [p.name for p in seg_dir.iterdir()] if seg_dir.exists() else []
    assert left == [], f"a clean stop left {left} in {seg_dir}"


def test_a_spare_being_made_when_the_stop_begins_is_removed(make_daemon: Any) -> None:
    # The save had to make its segment, which the memory tier will keep: the next
    # save's spare is begun at its grant, and held there. The save is acknowledged and
    # its write held; the stop begins; the write goes on and the tier keeps the step
    # (which asks for no other spare once the stop began: tests/test_spare_segments.py);
    # the spare, let go, is removed, not pooled, and the daemon exits clean.
    d: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": f"copied.wait=pause,{SPARE}=pause"})
    client = d.client("stopping")
    client.save(0, state_for(0, MIB), metadata={"step": 0})
    d.wait_failpoint(SPARE)
    d.wait_failpoint("copied.wait")
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    session = d.socket.with_name(d.socket.name + ".session")
    deadline = time.monotonic() + TIMEOUT
    while session.exists():  # it goes once the daemon stopped taking requests
        assert time.monotonic() < deadline and d.running(), d.log_tail()
        time.sleep(0.01)
    d.release("copied.wait")
    d.release(SPARE)
    assert d.proc.wait(TIMEOUT) == 0
    step = d.root / "stopping" / "0"
    assert step.is_dir(), "the save acknowledged before the stop was not finished"
    seg_dir = recorded_dir(d.root)
    assert seg_dir is not None and not seg_dir.exists()
