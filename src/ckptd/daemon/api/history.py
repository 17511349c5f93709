"""The daemon's record of each job's restarts, which ``Goodput()`` learns its failure
rate from (client/goodput.py).

A trainer that dies and is restarted restores its newest step: so a restore by a
process that did not restore that rank of the job before is one restart. Ranks
of one job restart together, so the job's count is the most of any rank, not
their sum; the time of each restart of the job (the first rank's) is kept too,
the newest :data:`RECENT` of them, so the policy can weigh recent failures
above old ones when the rate changes.

Time observed is *active* time: the stretches in which the job used the daemon
(a lease, a commit, a restore), a stretch ending at the job's last use when no
use follows for :data:`IDLE_GAP` seconds. A job that ended last week and runs
again today does not count the week between as failure-free time.

Kept in ``<root>/.history.json`` (written whole and renamed, at most every
:data:`FLUSH_EVERY` seconds of changes, and at every restart and at stop), so a
daemon restart or a later run of the same job starts from what was seen: a
young job starts from the node's record (every other job's restarts over their
active time: the *fleet* prior), not from nothing. A record that cannot be read
is set aside (named in the log) and the record starts again: it only tunes an
interval. Bounded: the :data:`MAX_JOBS` most recently used jobs, one process
identity per rank.

Each message also carries the node names' record from the bucket (``nodes``:
remote/node_fleet.py), which outlives a lost node as this file does not: the
time the sampled node names have been claimed and how often a new disk replaced
one, Goodput()'s node-loss rate. A daemon without a bucket sends 0 and 0.

Owned by the servicer's event loop (the only writer).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.core.manifest import MAX_UNIX
from ckptd.proto import ckptd_pb2 as pb

log = logging.getLogger(__name__)

IDLE_GAP = 3600.0
"""Seconds without a use of the job that end its active stretch."""
RECENT = 32
"""Restart times kept per job."""
MAX_JOBS = 512
FLUSH_EVERY = 60.0
"""Seconds between writes of the record for uses alone (a restart writes at once:
losing a use only shortens the time observed, which errs towards saving often)."""
FILE_NAME = ".history.json"


@dataclass
class _Job:
    first_seen: float
    active: float = 0.0
    """Seconds of the job's closed active stretches."""
    stretch: float = 0.0
    """Start of the open stretch."""
    last_used: float = 0.0
    last_restorer: dict[int, Hashable] = field(default_factory=dict)
    restores: dict[int, int] = field(default_factory=dict)
    restart_times: list[float] = field(default_factory=list)

    def use(self, now: float) -> None:
        if now - self.last_used > IDLE_GAP:
            self.active += max(self.last_used - self.stretch, 0.0)
            self.stretch = now
        self.last_used = max(self.last_used, now)

    def observed(self, now: float) -> float:
        open_until = now if now - self.last_used <= IDLE_GAP else self.last_used
        return self.active + max(open_until - self.stretch, 0.0)

    def restarts(self) -> int:
        return max(self.restores.values(), default=0)

    def to_json(self) -> dict[str, Any]:
        # Process identities do not outlive the daemon's processes' lives: not kept.
        return {
            "first_seen": self.first_seen,
            "active": self.active,
            "stretch": self.stretch,
            "last_used": self.last_used,
            "restores": {str(r): n for r, n in self.restores.items()},
            "restart_times": self.restart_times,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> _Job:
        """A job's record as :meth:`to_json` writes it; ValueError for a value it
        cannot have written (a time that is no time, a count past the wire's)."""
        return cls(
            first_seen=_time(doc["first_seen"]),
            active=_time(doc["active"]),
            stretch=_time(doc["stretch"]),
            last_used=_time(doc["last_used"]),
            restores={_count(r): _count(n) for r, n in doc["restores"].items()},
            restart_times=[_time(t) for t in doc["restart_times"]][-RECENT:],
        )


def _time(raw: Any) -> float:
    value = float(raw)
    if not (math.isfinite(value) and 0 <= value < MAX_UNIX):
        raise ValueError(f"{value} is not a time")
    return value


def _count(raw: Any) -> int:
    value = int(raw)
    if not 0 <= value < 2**32:
        raise ValueError(f"{value} is not a count")
    return value


def _uint(value: int, bits: int) -> int:
    """``value`` within a uint field of ``bits`` bits (saturated)."""
    return min(max(int(value), 0), (1 << bits) - 1)


def _seconds(value: float) -> float:
    """Non-negative and finite, or 0 (not known)."""
    return value if math.isfinite(value) and value >= 0 else 0.0


class JobHistory:
    """Per job: active time observed and the trainer's restarts; kept in ``path``
    (None: in memory only)."""

    def __init__(
        self,
        path: Path | None = None,
        clock: Callable[[], float] = time.time,
        nodes: Callable[[], tuple[float, int, int]] = lambda: (0.0, 0, 0),
    ) -> None:
        """``nodes``: the node names' record, (observed seconds, replacements, names)."""
        self._clock = clock
        self._nodes = nodes
        self._path = path
        self._jobs: dict[str, _Job] = self._load() if path is not None else {}
        self._dirty = False
        self._flushed = clock()

    # -- the record ---------------------------------------------------------------
    def seen(self, job: str) -> None:
        """The job used the daemon (a lease, a commit): start its record if new."""
        now = self._clock()
        rec = self._jobs.get(job)
        if rec is None:
            rec = self._jobs[job] = _Job(now, stretch=now, last_used=now)
            self._trim()
        rec.use(now)
        self._dirty = True
        self._flush(force=False)

    def restored(self, job: str, rank: int, process: Hashable) -> None:
        """``process`` restored ``rank`` of ``job``: a restart unless it did so before."""
        self.seen(job)
        rec = self._jobs[job]
        if rec.last_restorer.get(rank) == process:
            return
        before = rec.restarts()
        rec.last_restorer[rank] = process
        rec.restores[rank] = rec.restores.get(rank, 0) + 1
        if rec.restarts() > before:  # the job's first rank back: one restart of the job
            rec.restart_times = [*rec.restart_times, self._clock()][-RECENT:]
            self._flush(force=True)

    def restarts(self, job: str) -> int:
        """Restarts of ``job`` seen so far (the most of any rank)."""
        rec = self._jobs.get(job)
        return rec.restarts() if rec else 0

    def message(self, job: str) -> pb.JobHistory:
        """The record as the wire has it (``first_seen_unix`` 0: never seen).
        ``first_seen_unix`` is now minus the active time, so a client that reads
        only it and ``restarts`` counts active time too."""
        rec = self._jobs.get(job)
        if rec is None:
            return pb.JobHistory()
        now = self._clock()
        others = [r for j, r in self._jobs.items() if j != job]
        node_seconds, node_replacements, node_names = self._nodes()
        # Every value is bounded where it is read (the file, the bucket's records:
        # remote/records.py); saturated here too, so no value can fail the request.
        return pb.JobHistory(
            first_seen_unix=now - _seconds(rec.observed(now)),
            restarts=_uint(rec.restarts(), 32),
            restart_unix=rec.restart_times,
            fleet_observed_seconds=_seconds(sum(r.observed(now) for r in others)),
            fleet_restarts=_uint(sum(r.restarts() for r in others), 32),
            node_observed_seconds=_seconds(node_seconds),
            node_replacements=_uint(node_replacements, 64),
            node_names=_uint(node_names, 32),
        )

    def close(self) -> None:
        """Write what changed (the daemon stops)."""
        self._flush(force=True)

    # -- the file -----------------------------------------------------------------
    def _trim(self) -> None:
        if len(self._jobs) > MAX_JOBS:
            keep = sorted(self._jobs.items(), key=lambda kv: kv[1].last_used)[-MAX_JOBS:]
            self._jobs = dict(keep)

    def _load(self) -> dict[str, _Job]:
        assert self._path is not None
        try:
            doc = json.loads(self._path.read_text())
            return {str(j): _Job.from_json(r) for j, r in doc["jobs"].items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            aside = self._path.with_name(self._path.name + ".unreadable")
            log.warning(
                "the job history %s cannot be read (%s): set aside as %s; each job's "
                "failure rate is learned again from now",
                self._path,
                exc,
                aside.name,
            )
            with contextlib.suppress(OSError):  # a read-only root: read past it next time
                os.replace(self._path, aside)
            return {}

    def _flush(self, force: bool) -> None:
        now = self._clock()
        due = self._dirty and now - self._flushed >= FLUSH_EVERY
        if self._path is None or not (force or due):
            return
        tmp = self._path.with_name(self._path.name + ".tmp")
        doc = {"version": 1, "jobs": {j: r.to_json() for j, r in self._jobs.items()}}
        try:
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self._path)
        except OSError as exc:  # a full or read-only disk: the record stays in memory
            log.warning("cannot write the job history %s: %s", self._path, exc)
            return
        self._dirty, self._flushed = False, now


__all__ = ["FILE_NAME", "JobHistory"]
