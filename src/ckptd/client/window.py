"""A sliding window of measurements with one order statistic, computed once per change.

``Goodput()`` reads its medians and its base step's lower quartile several times a
step, and they change only when a measurement arrives: sorting the window on
every read made the policy, and the simulator that runs it over days of steps
(bench/goodput/sim.py), pay for sorts that gave the same answer.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterator


class Window:
    """The newest ``size`` values and their ``quantile`` (0.5: the median, the mean of
    the middle two in an even window; else the value at ``(n - 1) * quantile``)."""

    def __init__(self, size: int, quantile: float = 0.5) -> None:
        self._values: deque[float] = deque(maxlen=size)
        self._quantile = quantile
        self._stat: float | None = None

    def append(self, value: float) -> None:
        """Add ``value`` (the oldest goes when the window is full)."""
        self._values.append(value)
        self._stat = None

    def stat(self) -> float | None:
        """The window's quantile (None while it is empty)."""
        if self._stat is None and self._values:
            if self._quantile == 0.5:
                self._stat = statistics.median(self._values)
            else:
                ordered = sorted(self._values)
                self._stat = ordered[int((len(ordered) - 1) * self._quantile)]
        return self._stat

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[float]:
        return iter(self._values)


__all__ = ["Window"]
