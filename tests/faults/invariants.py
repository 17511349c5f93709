"""The invariants every fault test ends with, checked the same way after every fault.

1. Every acknowledged save is committed, or reported FAILED with a reason:
   never silently lost ("no save of step N").
2. Nothing partial is visible in any tier: every committed local step and every
   step with a marker in the bucket passes ``ckptd verify``; no staging or cache
   leftovers once the daemon is idle.
3. The newest complete step restores bit-exact.
4. Nothing leaks: no lease held, every shared-memory segment of the root is one
   the daemon accounts for, no staging directory, and the daemon's fds and
   threads are back within a small margin of the baseline taken at start.
"""

from __future__ import annotations

import gc
import itertools
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckptd.client import CheckpointNotFound, Client, SaveFailed
from ckptd.client.handle import SaveHandle
from ckptd.daemon.app.launcher import ckptd_command
from ckptd.daemon.local.staging import KEPT_SUFFIX, recorded_dir

from ..helpers import reservations_done

SHM = Path("/dev/shm")
_probe_steps = itertools.count(int(time.time()))  # a new step for every probe


def proc_counts(pid: int) -> tuple[int, int]:
    """(open fds, threads) of a process."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = int(
        next(
            line.split()[1]
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("Threads:")
        )
    )
    return fds, threads


@dataclass
class Ledger:
    """What the test's trainers were told: acknowledged saves and their contents."""

    job: str
    make: Callable[[int], dict[str, np.ndarray]]
    """The state saved at each step (deterministic, so it can be rebuilt to compare)."""
    acknowledged: list[int] = field(default_factory=list)
    evictable: set[int] = field(default_factory=set)
    """Steps the retention may have evicted meanwhile (gone is fine for them)."""

    def save(self, client: Client, step: int, **kw: Any) -> SaveHandle:
        """Save step ``step`` and record it once ``save()`` returned (acknowledged)."""
        handle = client.save(step, self.make(step), metadata={"step": step}, **kw)
        self.acknowledged.append(step)
        return handle


def check_saves(client: Client, ledger: Ledger, timeout: float = 120.0) -> dict[int, str]:
    """Invariant 1: each acknowledged save becomes LOCAL or FAILED with a reason.
    Returns ``{step: "LOCAL" | "FAILED: reason"}``."""
    outcome: dict[int, str] = {}
    remote_only = {c.step for c in client.list() if c.tiers == ("REMOTE",) and c.state == "DURABLE"}
    for step in ledger.acknowledged:
        if step in remote_only:  # committed, its local copy evicted or never fetched back
            outcome[step] = "DURABLE"
            continue
        try:
            SaveHandle(client, step).wait("local", timeout=timeout)
            outcome[step] = "LOCAL"
        except SaveFailed as exc:
            assert str(exc).strip(), f"step {step} failed without a reason"
            outcome[step] = f"FAILED: {exc}"
        except CheckpointNotFound:
            assert step in ledger.evictable, f"acknowledged step {step} was lost"
            outcome[step] = "EVICTED"
    return outcome


def check_visible(daemon: Any, remote_url: str = "", env: dict[str, str] | None = None) -> None:
    """Invariant 2: every copy visible in any tier verifies; nothing partial is left."""
    args = [*ckptd_command(), "verify", "--root", str(daemon.root)]
    if remote_url:
        args += ["--remote", remote_url]
    else:
        args += ["--local-only"]
    run = subprocess.run(
        args, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300
    )
    if run.returncode == 3:  # no copy visible at all: nothing partial either
        assert "nothing to verify" in run.stderr, run.stderr
    else:
        assert run.returncode == 0, f"ckptd verify found damage:\n{run.stdout}\n{run.stderr}"
    staging = daemon.root / ".staging"
    assert not staging.exists() or list(staging.iterdir()) == [], list(staging.iterdir())


def check_newest_restores(client: Client, ledger: Ledger, committed: set[int]) -> int:
    """Invariant 3: the newest committed step restores, bit-exact; returns its number."""
    newest = max(committed)
    tree, meta = client.restore()
    assert meta == {"step": newest}, f"restored {meta}, expected step {newest}"
    for key, want in ledger.make(newest).items():
        assert tree[key].tobytes() == want.tobytes(), f"step {newest}: {key} differs"
    return newest


def check_no_leaks(daemon: Any, baseline: tuple[int, int] | None = None) -> None:
    """Invariant 4: no lease, segment, staging directory, fd or thread left behind.
    Call with no restored arrays alive in this process."""
    gc.collect()
    # One more save takes back segments clients returned (the daemon notices on use).
    probe = daemon.client("leak-probe")
    probe.save(next(_probe_steps), {"p": np.zeros(8)}).wait("local", timeout=60)
    # Its reservation for a second save holds leases until it has mapped them (a
    # background call on its lease thread): done first, it holds none after.
    reservations_done(probe)
    status = daemon.status()
    assert status.leases_held == 0, f"{status.leases_held} leases still held"
    assert status.saves_in_flight == 0
    seg_dir = recorded_dir(daemon.root)
    assert seg_dir is not None
    # A spare segment being made in the background (local/spares.py) is counted in the
    # status before its file is complete: poll until the two meet (or time out).
    deadline = time.monotonic() + 30.0
    while True:
        # The memory tier's records (<segment>.kept) are not segments: each names one.
        on_disk = sum(p.stat().st_size for p in seg_dir.iterdir() if p.suffix != KEPT_SUFFIX)
        if on_disk == status.staging_allocated_bytes or time.monotonic() > deadline:
            break
        time.sleep(0.05)
        status = daemon.status()
    assert on_disk == status.staging_allocated_bytes, "segments in /dev/shm the daemon lost"
    if baseline is not None and daemon.proc is not None:
        fds, threads = proc_counts(daemon.proc.pid)
        # Margins: gRPC and the thread pools grow a little with use, not with faults.
        assert fds <= baseline[0] + 16, f"fds {baseline[0]} -> {fds}"
        assert threads <= baseline[1] + 16, f"threads {baseline[1]} -> {threads}"


def check_all(
    daemon: Any,
    client: Client,
    ledger: Ledger,
    *,
    remote_url: str = "",
    env: dict[str, str] | None = None,
    baseline: tuple[int, int] | None = None,
) -> dict[int, str]:
    """All four invariants; returns each acknowledged step's outcome."""
    outcome = check_saves(client, ledger)
    committed = {s for s, o in outcome.items() if o in ("LOCAL", "DURABLE")}
    check_visible(daemon, remote_url, env)
    if committed:
        check_newest_restores(client, ledger, committed)
    check_no_leaks(daemon, baseline)
    return outcome
