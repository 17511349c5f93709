"""Each job's upload pace: the drain starts an upload of a job at most every
``upload_interval_seconds`` (the job's newest commit says how often; 0: as soon
as the drain is free, the default).

This is the second level of ``Goodput()``'s two-level interval
(client/goodput.py): local saves as often as trainer failures make worth it, an
upload every ``k``-th of them where uploads cost the trainer (the drain's CPU and
network) and node losses are rarer. The steps the pace skips are SUPERSEDED when
a newer one of the job goes up (lifecycle/drain.py), so nothing waits on them
and the local retention may evict them; milestones go whatever the pace.

Kept in memory: a restarted daemon uploads each job's newest step at once until
the job's next commit sets its pace again (it errs towards uploading).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class UploadPace:
    """Per job: the interval between upload starts, and when the last one started."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._now = monotonic
        self._interval: dict[str, float] = {}
        self._started: dict[str, float] = {}

    def ask(self, job: str, seconds: float) -> None:
        """The job's newest commit asked for uploads at most every ``seconds``."""
        if seconds > 0 and math.isfinite(seconds):
            self._interval[job] = seconds
        else:
            self._interval.pop(job, None)

    def interval(self, job: str) -> float:
        """The job's interval (0: not paced)."""
        return self._interval.get(job, 0.0)

    def ready(self, job: str) -> bool:
        """Whether an upload of ``job`` may start now."""
        started = self._started.get(job)
        return started is None or self._now() - started >= self.interval(job)

    def started(self, job: str) -> None:
        """An upload of ``job``'s newest step starts."""
        self._started[job] = self._now()

    def next_due(self, jobs: set[str]) -> float:
        """Seconds until the first of ``jobs`` (with steps waiting) may upload (inf:
        none is held back)."""
        now, due = self._now(), math.inf
        for job in jobs:
            started = self._started.get(job)
            if started is not None and job in self._interval:
                due = min(due, max(started + self._interval[job] - now, 0.0))
        return due


__all__ = ["UploadPace"]
