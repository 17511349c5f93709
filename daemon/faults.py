"""Failpoints for fault-injection tests: named places where a test can stall the daemon.

``CKPTD_FAILPOINTS="write.mid=sleep(30),commit.before_rename=sleep(5)"`` makes the
daemon sleep at those points, so a test can SIGKILL it at a known moment. Unset
in production: each check is one dict lookup.
"""

from __future__ import annotations

import logging
import os
import re
import time

log = logging.getLogger("ckptd.faults")

_SPEC = re.compile(r"^\s*([a-z_.]+)\s*=\s*sleep\(([0-9.]+)\)\s*$")


def _parse(text: str) -> dict[str, float]:
    points: dict[str, float] = {}
    for part in filter(None, text.split(",")):
        m = _SPEC.match(part)
        if m is None:
            raise ValueError(f"bad failpoint {part!r} in CKPTD_FAILPOINTS; use NAME=sleep(SECONDS)")
        points[m.group(1)] = float(m.group(2))
    return points


_POINTS = _parse(os.environ.get("CKPTD_FAILPOINTS", ""))


def hit(name: str) -> None:
    """Stall here if a test armed this failpoint (blocking: call from worker threads)."""
    delay = _POINTS.get(name)
    if delay:
        log.warning("failpoint %s: sleeping %.1f s", name, delay)
        time.sleep(delay)
