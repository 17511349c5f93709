"""Failpoints for fault-injection tests: named places where a test can stall or fail the daemon.

``CKPTD_FAILPOINTS="write.mid=sleep(30),write.begin=enospc_once"`` makes the daemon
sleep at, or raise ``OSError(ENOSPC)`` from, those points, so a test can SIGKILL
it at a known moment or see how a failed write is reported. Unset in
production: each check is one dict lookup.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time

log = logging.getLogger("ckptd.faults")

_SPEC = re.compile(r"^\s*([a-z_.]+)\s*=\s*(sleep\(([0-9.]+)\)|enospc|enospc_once)\s*$")


def _parse(text: str) -> dict[str, str]:
    points: dict[str, str] = {}
    for part in filter(None, text.split(",")):
        m = _SPEC.match(part)
        if m is None:
            raise ValueError(
                f"bad failpoint {part!r} in CKPTD_FAILPOINTS; use NAME=sleep(SECONDS), "
                "NAME=enospc or NAME=enospc_once"
            )
        points[m.group(1)] = m.group(2)
    return points


_POINTS = _parse(os.environ.get("CKPTD_FAILPOINTS", ""))


def hit(name: str) -> None:
    """Act here if a test armed this failpoint (blocking: call from worker threads)."""
    action = _POINTS.get(name)
    if action is None:
        return
    if action.startswith("sleep("):
        delay = float(action[6:-1])
        log.warning("failpoint %s: sleeping %.1f s", name, delay)
        time.sleep(delay)
        return
    if action == "enospc_once":
        del _POINTS[name]
    log.warning("failpoint %s: raising ENOSPC", name)
    raise OSError(errno.ENOSPC, f"No space left on device (failpoint {name})")
