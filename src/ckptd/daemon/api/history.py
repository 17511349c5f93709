"""The daemon's record of each job's restarts, which ``Goodput()`` learns its failure
rate from (client/goodput.py).

A trainer that dies and is restarted restores its newest step: so a restore by a
process that did not restore that rank of the job before is one restart. Ranks
of one job restart together, so the job's count is the most of any rank, not
their sum. With the time the daemon first saw the job, that gives the policy an
estimate of the mean time between failures that needs no configuration.

Kept in memory, owned by the servicer (the only writer, on the event loop): a
daemon restart starts the record again, which makes the estimate shorter, so
the policy saves more often, never less. Bounded: one entry per job the daemon
has served, one process identity per rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from ckptd.proto import ckptd_pb2 as pb


@dataclass
class _Job:
    first_seen: float
    last_restorer: dict[int, Hashable] = field(default_factory=dict)
    restores: dict[int, int] = field(default_factory=dict)


class JobHistory:
    """Per job: when it was first seen and how many times its trainer restarted."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._jobs: dict[str, _Job] = {}

    def seen(self, job: str) -> None:
        """The job used the daemon (a lease, a commit): start its record if new."""
        if job not in self._jobs:
            self._jobs[job] = _Job(self._clock())

    def restored(self, job: str, rank: int, process: Hashable) -> None:
        """``process`` restored ``rank`` of ``job``: a restart unless it did so before."""
        self.seen(job)
        rec = self._jobs[job]
        if rec.last_restorer.get(rank) != process:
            rec.last_restorer[rank] = process
            rec.restores[rank] = rec.restores.get(rank, 0) + 1

    def restarts(self, job: str) -> int:
        """Restarts of ``job`` seen so far (the most of any rank)."""
        rec = self._jobs.get(job)
        return max(rec.restores.values(), default=0) if rec else 0

    def message(self, job: str) -> pb.JobHistory:
        """The record as the wire has it (``first_seen_unix`` 0: never seen)."""
        rec = self._jobs.get(job)
        if rec is None:
            return pb.JobHistory()
        return pb.JobHistory(first_seen_unix=rec.first_seen, restarts=self.restarts(job))


__all__ = ["JobHistory"]
