"""The trainer SIGKILLed at named points of save and restore; then the invariants must hold.

Each case starts a daemon, saves step 0 with the test's own client (so the
trainer has something to restore), starts trainer.py with one kill point, waits
for the marker file the trainer writes when it is there, SIGKILLs it, and runs
the shared invariant checks (invariants.py) with a fresh client of the same job:
every save the daemon acknowledged is LOCAL, nothing partial is visible, the
newest step restores bit-exact, and nothing leaks. A dead trainer's leases, the
one it was writing into and the restored segment it was lent, come back at
once, not after ``lease_timeout_seconds`` (600 s here). A few cases then run a
second trainer on the same job, which must restore the newest step bit-exact
and save more.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from ckptd.daemon.local.liveness import locked_by_others

from ..conftest import Daemon
from ..helpers import state_for
from .invariants import SHM, Ledger, check_all, proc_counts

TRAINER = Path(__file__).with_name("trainer.py")
MIB = 2
JOB = "trainee"
MARKER_TIMEOUT = 60.0
"""Bound on reaching a kill point: a trainer that never gets there fails the test."""


@dataclass(frozen=True)
class Case:
    """One kill point and what the case needs around it."""

    point: str
    steps: int = 3
    presave: bool = True
    """Save step 0 first, so the trainer starts with a restore."""
    failpoints: str = ""
    """``CKPTD_FAILPOINTS`` of the daemon; a paused one is released after the kill."""
    restore_lease: bool = False
    """The point is in a restore that must have been lent a segment (or it proves nothing)."""
    resume: bool = False
    """Afterwards, a second trainer restores the newest step and saves more."""
    jax: bool = False


CASES = [
    # Start-up: deciding whether to restore.
    Case("before:ListCheckpoints"),
    Case("after:ListCheckpoints"),
    # Restore: a segment the daemon filled and lends to the trainer.
    Case("before:Restore"),
    Case("after:Restore", restore_lease=True, resume=True),  # lent, not yet mapped or locked
    Case("before:ReleaseLease", restore_lease=True),  # mapped and locked, not confirmed
    Case("after:ReleaseLease", restore_lease=True, resume=True),  # held; arrays not built
    Case("after-restore-holding-arrays", restore_lease=True),
    # The first save: lease, copy, handoff.
    Case("before:AcquireLease"),
    Case("after:AcquireLease", resume=True),
    Case("mid-copy", resume=True),
    Case("before:CommitShards"),
    Case("after:CommitShards", resume=True),  # handed off; save() has not returned
    # Waiting for LOCAL (the first save is waited on, the second is not).
    Case("before:GetSaveStatus"),
    Case("after:GetSaveStatus"),
    # A fresh job: the first write stays paused, so the wait is still in flight.
    Case("during-wait", presave=False, failpoints="write.begin=pause"),
    # The second and third saves: should_save asks for room first.
    Case("before:CheckCapacity"),
    Case("after:CheckCapacity"),
    Case("between-saves"),  # two acknowledged, the second not waited on
    Case("save-2-of-3"),  # the second save's lease granted; the first save LOCAL
    Case("mid-copy#2"),
    Case("before:CommitShards#3"),
    Case("after:CommitShards#3"),
    Case("d2h", jax=True, resume=True),
]
FAST = {"after:AcquireLease", "mid-copy", "after:CommitShards", "after:ReleaseLease"}
"""Representative points run by default; the rest are marked faults (`make faults`)."""


def _param(case: Case) -> Any:
    return pytest.param(case, id=case.point, marks=() if case.point in FAST else pytest.mark.faults)


class Trainer:
    """trainer.py as a subprocess; its protocol lines are read on a thread."""

    def __init__(
        self, daemon: Daemon, point: str, marker: Path, steps: int, log: Path, jax: bool
    ) -> None:
        self.marker = marker
        self.log = log
        args = [sys.executable, str(TRAINER), "--socket", str(daemon.socket), "--job", JOB]
        args += ["--point", point, "--marker", str(marker), "--steps", str(steps)]
        args += ["--mib", str(MIB), *(["--jax"] if jax else [])]
        self._err: IO[str] = open(log, "w")  # noqa: SIM115 - closed in reap
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._err, text=True)
        self.lines: list[tuple[str, int]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            tag, _, value = line.partition(" ")
            self.lines.append((tag, int(value)))

    def stderr(self) -> str:
        """What the trainer printed on stderr (for failure messages)."""
        if not self._err.closed:  # finish() may have reaped it already
            self._err.flush()
        return self.log.read_text(errors="replace")[-4000:]

    def wait_marker(self) -> None:
        """Block until the trainer stands at its kill point (it writes the marker then).

        Polling a file the trainer writes, with a bound, is synchronising on the
        trainer itself; nothing here waits on the daemon's timing."""
        deadline = time.monotonic() + MARKER_TIMEOUT
        while not self.marker.exists():
            if self.proc.poll() is not None:
                pytest.fail(
                    f"the trainer exited ({self.proc.returncode}) before reaching its kill point; "
                    f"it printed {self.lines}:\n{self.stderr()}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"the trainer did not reach its kill point:\n{self.stderr()}")
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL, then read every line it printed before dying."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.reap()
        assert self.proc.returncode == -signal.SIGKILL

    def finish(self, timeout: float = 120.0) -> None:
        """Wait for a trainer that runs to its end; it must exit 0."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.reap()
        assert self.proc.returncode == 0, f"trainer failed:\n{self.stderr()}"

    def reap(self) -> None:
        """Wait for the process and its reader; close the stderr file."""
        self.proc.wait(30)
        self._reader.join(30)
        self._err.close()

    def steps(self, *tags: str) -> list[int]:
        """Steps of the lines with one of ``tags`` (``ACK``, ``HANDED``, ``RESTORED``...)."""
        return sorted({value for tag, value in self.lines if tag in tags})


def _check_liveness_files(pid: int) -> None:
    """A dead trainer's liveness file is gone (the daemon tidied it when it reclaimed a
    lease) or harmless: empty and locked by nobody, so no lease can be pinned by it."""
    for path in SHM.glob(f"ckptd-client-{pid}-*"):
        with contextlib.suppress(FileNotFoundError):
            assert path.stat().st_size == 0, f"{path} holds data"
            assert not locked_by_others(path), f"{path} is still locked after its trainer died"
            # The daemon removes it only when it reclaims a lease named by it; a trainer
            # killed while it held none leaves it behind. Tidy up after ourselves.
            path.unlink()


def _acknowledged(trainer: Trainer) -> list[int]:
    """What the daemon acknowledged to the trainer.

    ``save()`` returning (ACK) and, for a trainer killed between the CommitShards
    reply and ``save()`` returning, the reply itself (HANDED), or for a commit sent
    while copying the reply and the word that the lease is whole (REPLIED and
    WHOLE): the daemon owns those bytes, so that step must be committed like any
    other (and it may be the newest, which the restore check compares against)."""
    both = set(trainer.steps("REPLIED")) & set(trainer.steps("WHOLE"))
    return sorted({*trainer.steps("ACK", "HANDED"), *both})


def _run_point(daemon: Daemon, ledger: Ledger, case: Case, tmp_path: Path) -> Trainer:
    """Start a trainer, wait until it stands at ``case.point``, SIGKILL it."""
    marker = tmp_path / "marker"
    trainer = Trainer(daemon, case.point, marker, case.steps, tmp_path / "trainer1.err", case.jax)
    try:
        trainer.wait_marker()
        paused = [fp.partition("=")[0] for fp in case.failpoints.split(",") if fp]
        for name in paused:
            daemon.wait_failpoint(name)  # the daemon is stopped where the case needs it
        trainer.kill()
        for name in paused:
            daemon.release(name)
    finally:
        if trainer.proc.poll() is None:
            trainer.proc.kill()
            trainer.reap()
    ledger.acknowledged = sorted({*ledger.acknowledged, *_acknowledged(trainer)})
    return trainer


class _LaterRound:
    """The daemon as :func:`check_all` sees it in a second round on the same daemon.

    ``check_no_leaks`` probes with step 0 of job ``leak-probe``, which the first
    round saved (saving it again is a Conflict); this hands it a job of its own
    per round and passes everything else through."""

    def __init__(self, daemon: Daemon, round_no: int) -> None:
        self._daemon = daemon
        self._round = round_no

    def client(self, job: str = "job", **kw: Any) -> Any:
        return self._daemon.client(f"{job}-{self._round}" if job == "leak-probe" else job, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._daemon, name)


def _check(daemon: Daemon, ledger: Ledger, baseline: tuple[int, int], round_no: int = 1) -> None:
    """The shared invariants with a fresh client, and then no lease at all."""
    # The local tier keeps the newest 3 (the default KeepLatest(3)): older steps may
    # be gone by now (a restore into shared memory does not hold a step back).
    ledger.evictable = set(ledger.acknowledged[:-3])
    client = daemon.client(JOB)
    target = daemon if round_no == 1 else _LaterRound(daemon, round_no)
    outcome = check_all(target, client, ledger, baseline=baseline)
    # A trainer's death is no reason to fail a save the daemon owns: every one is LOCAL
    # (or evicted by retention since, which the ledger allows for).
    assert {o for s, o in outcome.items() if s not in ledger.evictable} <= {"LOCAL"}, outcome
    # check_no_leaks asserted this after one probe save; the lease timeout is 600 s,
    # so a dead trainer's lease (save or restore) came back because it died.
    assert daemon.status().leases_held == 0


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_trainer_sigkilled_at_point(make_daemon: Any, tmp_path: Path, case: Case) -> None:
    if case.jax:
        pytest.importorskip("jax")
    env = {"CKPTD_FAILPOINTS": case.failpoints} if case.failpoints else {}
    daemon: Daemon = make_daemon(env=env)
    assert daemon.proc is not None
    baseline = proc_counts(daemon.proc.pid)
    ledger = Ledger(JOB, make=lambda s: state_for(s, MIB))
    if case.presave:
        ledger.save(daemon.client(JOB), 0).wait("local", timeout=60)

    trainer = _run_point(daemon, ledger, case, tmp_path)
    if case.restore_lease:
        assert ("RESTORE-LEASE", 1) in trainer.lines, (
            f"the restore was not lent a segment, so {case.point} tested nothing: {trainer.lines}"
        )
    _check(daemon, ledger, baseline)
    _check_liveness_files(trainer.proc.pid)

    if not case.resume:
        return
    # A new trainer on the same job: restores the newest step bit-exact (it checks the
    # bytes itself) and goes on saving.
    newest = max(ledger.acknowledged)
    again = Trainer(daemon, "none", tmp_path / "marker2", 2, tmp_path / "trainer2.err", case.jax)
    again.finish()
    assert again.steps("RESTORED") == [newest], again.lines
    assert again.steps("ACK") == [newest + 1, newest + 2], again.lines
    ledger.acknowledged = sorted({*ledger.acknowledged, *again.steps("ACK")})
    _check(daemon, ledger, baseline, round_no=2)
