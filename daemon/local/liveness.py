"""Client liveness: a lease comes back as soon as the client that holds it is gone.

Each client process holds a shared flock on a small file in the shm directory,
``ckptd-client-<pid>-<hex>``, for its whole life, and names it in the
:data:`HOLDER_HEADER` metadata of the calls that get it a lease. The kernel
drops the lock when the process dies, however it dies, so "nobody holds the
lock" means "the client is gone": no timer, no heartbeat.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
from pathlib import Path

from ckptd.core.errors import InvalidArgument

HOLDER_HEADER = "ckptd-holder"
"""gRPC metadata: the name of the calling client's liveness file in the shm dir."""
SWEEP_SECONDS = 60.0
"""How often liveness files of dead clients that held no lease are tidied."""
HOLDER_PATTERN = re.compile(r"ckptd-client-[0-9]{1,10}-[0-9a-f]{8,32}")


def sweep_dead_clients(shm_dir: Path) -> int:
    """Remove liveness files of clients that died holding no lease."""
    removed = 0
    for path in shm_dir.glob("ckptd-client-*"):
        if HOLDER_PATTERN.fullmatch(path.name) and not locked_by_others(path):
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
    return removed


def check_holder(holder: str) -> None:
    """A holder name must be a liveness file name a client makes (it becomes a path)."""
    if holder and not HOLDER_PATTERN.fullmatch(holder):
        raise InvalidArgument(f"malformed {HOLDER_HEADER} {holder[:80]!r}")


def locked_by_others(path: Path) -> bool:
    """True while some process holds a flock on ``path`` (a client using restored memory)."""
    try:
        # No symlink, no blocking open (a FIFO planted under a holder's name): a
        # name that is not a plain file stands for no live client.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing also drops our probe lock
    return False
