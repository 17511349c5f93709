"""The daemon's one retry schedule: a pause that doubles with each attempt, up to a
cap, optionally with full jitter.

The drain's transient upload errors (with jitter: many nodes retrying one bucket
must not retry in step), the drain's next try of an upload that failed for good,
and the supervisor's restart of a background service that crashed all wait by it.
"""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    """``initial`` seconds before the first retry, doubling per attempt up to
    ``maximum``; with ``jitter``, a uniform fraction of that (full jitter: AWS's
    "Exponential Backoff And Jitter"). ``rand`` is injectable for tests."""

    def __init__(
        self,
        initial: float,
        maximum: float,
        jitter: bool = False,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.initial, self.maximum, self.jitter, self.rand = initial, maximum, jitter, rand

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        pause = min(self.maximum, self.initial * 2 ** max(0, attempt))
        return float(self.rand() * pause) if self.jitter else float(pause)
