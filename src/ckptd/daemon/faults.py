"""Failpoints for fault-injection tests: named places where a test can stall or fail the daemon.

``CKPTD_FAILPOINTS="write.mid=pause,write.begin=enospc_once"`` arms those points:

- ``pause``: the first time the daemon gets there it stops and waits until the
  test releases it (the test learns it got there from a file, not from a sleep
  window or the log: :func:`wait_hit`, :func:`release`; the directory is
  ``$CKPTD_FAILPOINT_DIR``, which the launcher sets). Later hits pass.
- ``sleep(SECONDS)``: every hit sleeps (to slow something down, never to sync on).
- ``enospc`` / ``enospc_once``: raise ``OSError(ENOSPC)`` (every time / once).

Unset in production: each check is one dict lookup. Checks block: call them from
worker threads (``asyncio.to_thread(faults.hit, name)`` on the loop).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("ckptd.faults")

DIR_VARIABLE = "CKPTD_FAILPOINT_DIR"
_SPEC = re.compile(r"^\s*([a-z_.]+)\s*=\s*(sleep\(([0-9.]+)\)|enospc|enospc_once|pause)\s*$")
_POLL = 0.01


def _parse(text: str) -> dict[str, str]:
    points: dict[str, str] = {}
    for part in filter(None, text.split(",")):
        m = _SPEC.match(part)
        if m is None:
            raise ValueError(
                f"bad failpoint {part!r} in CKPTD_FAILPOINTS; use NAME=pause, "
                "NAME=sleep(SECONDS), NAME=enospc or NAME=enospc_once"
            )
        points[m.group(1)] = m.group(2)
    return points


_POINTS = _parse(os.environ.get("CKPTD_FAILPOINTS", ""))


def armed(name: str) -> bool:
    """Whether a test armed this failpoint (so code on the event loop can skip the
    thread hop that :func:`hit` needs when it is not)."""
    return name in _POINTS


def hit(name: str) -> None:
    """Act here if a test armed this failpoint (blocking: call from worker threads)."""
    action = _POINTS.get(name)
    if action is None:
        return
    if action in ("pause", "enospc_once") and _POINTS.pop(name, None) is None:
        return  # a once-only point another thread took first (pop is atomic)
    if action == "pause":
        directory = Path(os.environ.get(DIR_VARIABLE, "."))
        log.warning("failpoint %s: paused until released in %s", name, directory)
        (directory / f"{name}.hit").touch()
        while not (directory / f"{name}.release").exists():
            time.sleep(_POLL)
        return
    if action.startswith("sleep("):
        delay = float(action[6:-1])
        log.warning("failpoint %s: sleeping %.1f s", name, delay)
        time.sleep(delay)
        return
    log.warning("failpoint %s: raising ENOSPC", name)
    raise OSError(errno.ENOSPC, f"No space left on device (failpoint {name})")


def wait_hit(
    directory: Path, name: str, timeout: float, alive: Callable[[], bool] = lambda: True
) -> None:
    """(Test side) Block until a daemon paused at failpoint ``name``."""
    deadline = time.monotonic() + timeout
    while not (directory / f"{name}.hit").exists():
        if not alive():
            raise RuntimeError(f"the daemon exited before reaching failpoint {name}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemon did not reach failpoint {name} within {timeout} s")
        time.sleep(_POLL)


def release(directory: Path, name: str) -> None:
    """(Test side) Let a daemon paused at failpoint ``name`` go on."""
    (directory / f"{name}.release").touch()
