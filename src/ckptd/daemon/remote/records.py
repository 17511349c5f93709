"""Bounds on every field read from the bucket, and the one warning per bad record.

Anyone with write access to the bucket can put any bytes under any key ckptd
reads (docs/security.md). So each record read there (a node name's claim and the
fleet's sample of them, a node's step index and markers, ranks records,
manifests: core/manifest.py) is checked for type and range before it is used:
an int within what every wire field it can reach holds, a time finite and in
``[0, MAX_UNIX)``, a duration finite and non-negative, a string, a list or a map
of bounded size. A record that fails is not one ckptd wrote: it is skipped (a
field that is only a hint falls back to its default), logged once per key
(the same keys are read again at every refresh or request), and never fails
the request, the drain or the save that read it.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

from ckptd.core.errors import InvalidArgument
from ckptd.core.manifest import MAX_UNIX
from ckptd.core.names import check_name

log = logging.getLogger("ckptd.remote")

MAX_METRICS = 512
"""Most metrics one step may carry: a save's 256 and the daemon's own beside them."""
MAX_METRIC_NAME = 255
"""Longest metric name a save may give (characters)."""
MAX_COUNT = 2**32
"""Most a count read from the bucket may say (a node name's replacements): a sum of
the fleet's sample fits the wire's uint64 with room to spare."""


class OutOfBounds(ValueError):
    """A field of a bucket record that ckptd could not have written."""


def integer(raw: Any, name: str, low: int, high: int) -> int:
    """``raw`` as an int in ``[low, high)`` (a bool, a float or a string is not one)."""
    if type(raw) is not int or not low <= raw < high:
        raise OutOfBounds(f"{name} = {str(raw)[:40]!r} is not an integer in [{low}, {high})")
    return raw


def seconds(raw: Any, name: str, high: float = MAX_UNIX) -> float:
    """``raw`` as a finite number of seconds (or unix time) in ``[0, high)``."""
    if type(raw) not in (int, float) or not (math.isfinite(raw) and 0 <= raw < high):
        raise OutOfBounds(f"{name} = {str(raw)[:40]!r} is not a time in [0, {high:g})")
    return float(raw)


def seconds_or(raw: Any, default: float = 0.0) -> float:
    """:func:`seconds`, or ``default`` for a field that is only a hint."""
    try:
        return seconds(raw, "")
    except OutOfBounds:
        return default


def text(raw: Any, name: str, most: int = 255) -> str:
    """``raw`` as a string of at most ``most`` bytes (UTF-8)."""
    if not isinstance(raw, str) or len(raw) > most or len(raw.encode(errors="replace")) > most:
        raise OutOfBounds(f"{name} is not a string of at most {most} bytes")
    return raw


def metrics(raw: Any) -> dict[str, float]:
    """A step's metrics from a record: the finite numbers under names of 1 to
    :data:`MAX_METRIC_NAME` characters, at most :data:`MAX_METRICS` of them (the
    rest are dropped: metrics only steer retention's ``KeepBest``)."""
    out: dict[str, float] = {}
    for k, v in raw.items() if isinstance(raw, dict) else ():
        if len(out) == MAX_METRICS:
            break
        if not (isinstance(k, str) and 0 < len(k) <= MAX_METRIC_NAME):
            continue
        if type(v) in (int, float) and math.isfinite(v):
            out[k] = float(v)
    return out


_WARNED_MAX = 10_000
_warned: set[str] = set()
_warned_lock = threading.Lock()


def skipped(key: str, why: str) -> None:
    """Log that the record at ``key`` was skipped, the first time only (at most
    :data:`_WARNED_MAX` keys are remembered: then the log stays quiet)."""
    with _warned_lock:
        first = key not in _warned and len(_warned) < _WARNED_MAX
        if first:
            _warned.add(key)
    if first:
        log.warning("skipping bucket record %r: %s", key[:300], why[:500])


def valid_names(key: str, **names: str) -> bool:
    """Whether each name in a listed key is valid; a bad one is logged once per key
    (listings repeat at every refresh) and the key is skipped, never used in a path."""
    for kind, value in names.items():
        try:
            check_name(kind, value)
        except InvalidArgument as exc:
            skipped(key, str(exc))
            return False
    return True


__all__ = [
    "MAX_COUNT",
    "MAX_METRICS",
    "MAX_METRIC_NAME",
    "OutOfBounds",
    "integer",
    "metrics",
    "seconds",
    "seconds_or",
    "skipped",
    "text",
    "valid_names",
]
