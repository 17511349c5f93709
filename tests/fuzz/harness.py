"""The live daemon a fuzz run calls, what each call must satisfy, and the run's summary.

Per call: the status is one a client can act on (never INTERNAL or UNKNOWN), the
message is non-empty and carries no traceback, and the call returns in bounded
time. Around the run: the daemon stays alive and answers ``GetStatus``; nothing
appears outside its root, its bucket and the directories a successful ``Watch`` or
``EnsureLocal`` named; its shared memory is all given back once the run's leases
are released, and its segments are gone once it stops.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckptd.client import Client
from ckptd.core.errors import CkptdError
from ckptd.core.names import MAX_JOB_BYTES
from ckptd.core.wire import Connection
from ckptd.daemon.app.launcher import DaemonProcess
from ckptd.proto import ckptd_pb2 as pb

from .sentinel import Sentinel, shm_segments
from .strategies import Case, Context

ALLOWED = frozenset(
    {
        "OK",
        "INVALID_ARGUMENT",
        "FAILED_PRECONDITION",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "RESOURCE_EXHAUSTED",
        "PERMISSION_DENIED",
        "DATA_LOSS",
        "ABORTED",
        "UNAUTHENTICATED",
    }
)
"""Statuses a client mistake may get; DEADLINE_EXCEEDED only for a long wait it asked for."""
CASE_DEADLINE = 30.0
"""A call that has not returned by then hangs (every wait is clamped far below it)."""
LONG_WAIT_DEADLINE = 1.0
"""Client deadline of a call whose wait field asks for more than LONG_WAIT seconds."""
CHECK_EVERY = 250
"""Cases between liveness checks."""
JOBS = ["fz-a", "fz-b", "fz.c_d", "L" * MAX_JOB_BYTES]
"""Jobs with real checkpoints; the last is as long as a job name may be."""
TRACEBACK = "Traceback (most recent call last)"
DAMAGE = ("does not verify", "set aside", "is corrupt", "not a valid manifest")
"""A fuzz run damages no file: a log line reporting damage is a bug (a step acknowledged
that the daemon cannot read back)."""
PENDING: tuple[tuple[str, str], ...] = ()
"""INTERNAL statuses whose fix belongs in a file this branch may not edit, as (RPC,
text of the message): counted under ``pending_in_servicer`` instead of failing the
run until the fix lands. Keep it empty."""


@dataclass
class Summary:
    """What a run did and saw."""

    cases: int = 0
    setup_calls: int = 0
    per_rpc: dict[str, Counter[str]] = field(default_factory=dict)
    statuses: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    violation_count: int = 0
    slowest_seconds: float = 0.0
    slowest_rpc: str = ""
    liveness_checks: int = 0
    pending: Counter[str] = field(default_factory=Counter)

    def record(self, method: str, code: str, seconds: float) -> None:
        """Count one case."""
        self.cases += 1
        self.per_rpc.setdefault(method, Counter())[code] += 1
        self.statuses[code] += 1
        if seconds > self.slowest_seconds:
            self.slowest_seconds, self.slowest_rpc = seconds, method

    def violate(self, text: str) -> None:
        """Keep the first 50 violations, count them all."""
        self.violation_count += 1
        if len(self.violations) < 50:
            self.violations.append(text[:1500])


class Harness:
    """One ``ckptd serve`` with a file:// remote, a sentinel directory, and the checks."""

    def __init__(self, base: Path, staging_budget: str = "128MiB") -> None:
        self.base = base
        self.root = base / "root"
        self.bucket = base / "bucket"
        self.daemon = DaemonProcess(
            self.root,
            node_id="fuzz-node",
            staging_budget=staging_budget,
            extra_args=[
                "--remote",
                f"file://{self.bucket}",
                "--lease-timeout-seconds",
                "5",
                "--step-timeout-seconds",
                "5",
                "--drain-retry-max-seconds",
                "1",
                "--adopt-dirs",
                str(base / "sentinel"),
            ],
            log_path=base / "daemon.log",
        )
        self.sentinel = Sentinel(base, self.root, {self.root, self.bucket, base / "daemon.log"})
        self.ctx = Context(
            self.sentinel.dir,
            jobs=list(JOBS),
            paths=self.sentinel.valid_paths(),
            hostile_paths=self.sentinel.hostile_paths(),
        )
        self.summary = Summary()
        self.all_leases: set[str] = set()
        self.rng = random.Random(12)
        self.started = 0.0
        self.dead = ""
        self.facts: dict[str, Any] = {}

    # -- set-up ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the daemon and give it real checkpoints, an adopted step and a watch."""
        self.facts["segments_before_start"] = shm_segments(self.root)
        self.daemon.start()
        self.conn = Connection(self.daemon.socket, timeout=CASE_DEADLINE)
        for i, job in enumerate(JOBS):
            with Client(job, socket=self.daemon.socket) as client:
                for step in (1, 2):
                    client.save(step, {"x": np.arange(4 + i), "y": {"z": np.ones(3)}}).wait(
                        "durable", timeout=60
                    )
                    self.ctx.steps.append((job, step))
        self.conn.adopt(pb.AdoptRequest(job="fz-a", step=1000, path=self.ctx.paths[0]))
        self.ctx.steps.append(("fz-a", 1000))
        watch = self.conn.watch(pb.WatchRequest(job="fz-b", directory=self.ctx.paths[1]))
        self.sentinel.allow(watch.directory)
        self.started = time.monotonic()

    def begin(self) -> None:
        """Start a fresh summary (a module may run more than once against the daemon)."""
        self.summary = Summary()
        self.started = time.monotonic()

    # -- one case -------------------------------------------------------------------------
    def _setup_call(self, method: str, request: Any) -> Any:
        self.summary.setup_calls += 1
        try:
            return self.conn.call_by_name(method, request, timeout=CASE_DEADLINE)
        except CkptdError:
            return None

    def _fresh_lease(self, case: Case) -> None:
        """A valid CommitShards gets a lease granted for its job, big enough for its shards."""
        req = case.request
        job = req.job if req.job in self.ctx.jobs else self.ctx.jobs[0]
        ends = [s.offset + s.length for s in req.shards]
        t = req.table
        if len(t.offset) == len(t.length) and len(t.offset) % 8 == 0:  # hostile ones: skip
            ends += (np.frombuffer(t.offset, "<u8") + np.frombuffer(t.length, "<u8")).tolist()
        need = max([*ends, 16]) + req.data_offset
        size = need if need <= 4 * 2**20 else 4096
        lease = self._setup_call("AcquireLease", pb.AcquireLeaseRequest(job=job, size_bytes=size))
        if lease is None:  # the budget is held by leases this run left: give them back
            self.release_all()
            lease = self._setup_call(
                "AcquireLease", pb.AcquireLeaseRequest(job=job, size_bytes=size)
            )
        if lease is not None:
            req.lease_id = lease.lease_id
            self.all_leases.add(lease.lease_id)
        if "step" not in case.hostile and self.rng.random() < 0.8:
            req.step = self.rng.randrange(10_000, 2**40)

    def run_case(self, case: Case) -> None:
        """Make one call and check what came back."""
        if self.dead:
            return
        if case.method == "CommitShards" and "lease_id" not in case.hostile:
            self._fresh_lease(case)
        deadline = LONG_WAIT_DEADLINE if case.waits_long() else CASE_DEADLINE
        t0 = time.monotonic()
        code, message, response = "OK", "", None
        try:
            response = self.conn.call_by_name(case.method, case.request, deadline, case.metadata)
        except CkptdError as exc:
            code, message = exc.code, str(exc)
        except Exception as exc:  # the client could not even send it
            code, message = "CLIENT_" + type(exc).__name__, str(exc)
        seconds = time.monotonic() - t0
        self.summary.record(case.method, code, seconds)
        self._check(case, code, message, seconds)
        if code == "OK":
            self._learn(case, response)
        if self.summary.cases % CHECK_EVERY == 0:
            self.check_alive()

    def _check(self, case: Case, code: str, message: str, seconds: float) -> None:
        what = f"{case.method}({_short(case.request)}) -> {code}: {message[:600]!r}"
        if code == "DEADLINE_EXCEEDED":
            if not case.waits_long():
                self.summary.violate(f"no answer within {CASE_DEADLINE} s: {what}")
        elif code == "UNAVAILABLE":
            self.dead = what
            self.summary.violate(f"daemon unreachable: {what}")
        elif code == "INTERNAL" and any(
            case.method == m and text in message for m, text in PENDING
        ):
            self.summary.pending[f"{case.method}: {message[:120]}"] += 1
        elif code not in ALLOWED:
            self.summary.violate(f"status {code}: {what}")
        elif code != "OK" and not message.strip():
            self.summary.violate(f"empty message: {what}")
        if TRACEBACK in message or 'File "/' in message:
            self.summary.violate(f"traceback in the message: {what}")
        if seconds > CASE_DEADLINE:
            self.summary.violate(f"took {seconds:.1f} s: {what}")

    def _learn(self, case: Case, response: Any) -> None:
        req = case.request
        if case.method == "AcquireLease":
            self._add_lease(response.lease_id)
        elif case.method == "Restore" and response.HasField("lease"):
            self._add_lease(response.lease.lease_id)
        elif case.method in ("CommitShards", "Adopt") and len(self.ctx.steps) < 5000:
            self.ctx.steps.append((req.job, req.step))
        elif case.method == "Watch":  # it creates the directory, wherever that resolves
            self.sentinel.allow(response.directory)
        elif case.method == "EnsureLocal":
            self.sentinel.allow(str(Path(response.path).parent))

    def _add_lease(self, lease_id: str) -> None:
        self.all_leases.add(lease_id)
        self.ctx.leases = [*self.ctx.leases[-49:], lease_id]

    # -- around the run -------------------------------------------------------------------
    def check_alive(self) -> bool:
        """The process runs and answers GetStatus; a violation otherwise."""
        self.summary.liveness_checks += 1
        if not self.daemon.running():
            self.dead = self.dead or "the daemon process exited"
            self.summary.violate(f"daemon dead: {self.dead}\n{self.daemon.log_tail()}")
            return False
        try:
            self.conn.get_status(pb.GetStatusRequest(), timeout=10)
        except CkptdError as exc:
            self.summary.violate(f"GetStatus failed: {exc.code}: {exc}")
            return False
        return True

    def release_all(self) -> None:
        """Give back every lease this run was granted (unknown ones answer NOT_FOUND)."""
        for lease_id in sorted(self.all_leases):
            self._setup_call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id))
        self.all_leases.clear()
        self.ctx.leases = []

    def quiesce(self, timeout: float = 60.0) -> pb.DaemonStatus:
        """Release the run's leases and wait until no shared memory is in use."""
        self.release_all()
        deadline = time.monotonic() + timeout
        while True:
            status: pb.DaemonStatus = self.conn.get_status(pb.GetStatusRequest())
            idle = status.leases_held == 0 and status.staging_in_use_bytes == 0
            if idle or time.monotonic() > deadline:
                return status
            time.sleep(0.25)

    def finish(self, report: Path | None, extra: dict[str, Any]) -> dict[str, Any]:
        """Quiesce, run the end-of-run checks and write the summary (JSON) if asked."""
        wall = time.monotonic() - self.started
        alive = self.check_alive()
        status = self.quiesce() if alive else None
        segments_running = shm_segments(self.root)
        outside = self.sentinel.check(self.ctx.generated_names)
        restart = self.restart() if alive else None
        log = self.daemon.log_text()
        damage = [line for line in log.splitlines() if any(b in line for b in DAMAGE)]
        s = self.summary
        result: dict[str, Any] = {
            **extra,
            "cases": s.cases,
            "setup_calls": s.setup_calls,
            "wall_seconds": round(wall, 1),
            "cases_per_second": round(s.cases / wall, 1) if wall else 0.0,
            "per_rpc": {
                m: {"cases": sum(c.values()), **dict(c)} for m, c in sorted(s.per_rpc.items())
            },
            "statuses": dict(s.statuses.most_common()),
            "slowest_case": {"rpc": s.slowest_rpc, "seconds": round(s.slowest_seconds, 2)},
            "daemon_alive": alive and not self.dead,
            "liveness_checks": s.liveness_checks,
            "outside_root": outside,
            "staging_after_release": {
                "leases_held": status.leases_held if status else None,
                "in_use_bytes": status.staging_in_use_bytes if status else None,
                "allocated_bytes": status.staging_allocated_bytes if status else None,
                "job_errors": status.job_errors if status else None,
                "task_restarts": {t.name: t.restarts for t in status.tasks} if status else None,
            },
            "segments": {
                "before_start": self.facts["segments_before_start"],
                "after_release_running": segments_running,
            },
            "daemon_log_tracebacks": log.count(TRACEBACK),
            "restart": restart,
            "damage_reported": damage[:20],
            "pending_in_servicer": dict(s.pending),
            "violation_count": s.violation_count,
            "violations": s.violations,
        }
        self.result, self.report = result, report
        self.write()
        return result

    def restart(self) -> dict[str, Any]:
        """Stop the daemon and start it again on the same root: it must come back with
        every committed step (a step it acknowledged but cannot read back is set aside,
        which the damage check then reports)."""
        listed = self.conn.list_checkpoints(pb.ListCheckpointsRequest())
        local = sum(1 for c in listed.checkpoints if pb.TIER_LOCAL in c.tiers)
        offset = len(self.daemon.log_text())
        self.daemon.stop()
        self.daemon.start()
        found = re.search(r"recovered (\d+) committed steps", self.daemon.log_text()[offset:])
        return {
            "local_steps_before": local,
            "recovered": int(found.group(1)) if found else None,
            "alive_after": self.check_alive(),
        }

    def stop(self) -> int:
        """Stop the daemon; the segments it leaves (must be none)."""
        self.conn.close()
        self.daemon.close()
        left = shm_segments(self.root)
        if hasattr(self, "result"):
            self.result["segments"]["after_stop"] = left
            self.write()
        return left

    def write(self) -> None:
        """Write the summary to the report file, if one was asked for."""
        if self.report is not None:
            self.report.parent.mkdir(parents=True, exist_ok=True)
            self.report.write_text(json.dumps(self.result, indent=1, default=str) + "\n")


def _short(msg: Any) -> str:
    text = " ".join(str(msg).split())
    return text if len(text) <= 300 else text[:300] + "..."
