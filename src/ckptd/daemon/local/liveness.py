"""Client liveness: a lease comes back as soon as the client that holds it is gone.

Each client process holds a shared flock on a small file in the shm directory,
``ckptd-client-<pid>-<hex>``, for its whole life, and names it in the
:data:`HOLDER_HEADER` metadata of the calls that get it a lease. The kernel
drops the lock when the process dies, however it dies, so "nobody holds the
lock" means "the client is gone": no timer, no heartbeat.

That file is only a hint that frees memory sooner: another user may open it and
hold a lock on it too, so it can never be what keeps a lease. A lease granted
to a process is kept by that process itself: :func:`wait_gone` follows it with
a pidfd once its last session closed (api/sessions.py).
"""

from __future__ import annotations

import asyncio
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


def _stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` from the third on (state first); None if
    unreadable. The command name (field 2) may hold spaces and parentheses: split
    after it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return raw[raw.rindex(b")") + 2 :].split()
    except (OSError, ValueError):
        return None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc/<pid>/stat``
    field 22): with the pid, a name no later process can have. None if unknown."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except (ValueError, IndexError):
        return None


def process_running(pid: int, started: int) -> bool:
    """Whether process ``pid`` that started at ``started`` still runs (not a zombie)."""
    fields = _stat(pid)
    try:
        return fields is not None and fields[0] not in (b"Z", b"X") and int(fields[19]) == started
    except (ValueError, IndexError):
        return False


async def wait_gone(pid: int, started: int | None, timeout: float) -> bool:
    """True once process ``pid``, started at ``started``, has exited (a zombie
    counts as exited); False after ``timeout`` seconds if it still runs. A process
    that cannot be followed (no pidfd on this kernel, a pid of another namespace)
    is waited for the whole timeout."""
    if pid <= 0 or started is None:
        await asyncio.sleep(timeout)
        return False
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True  # exited and reaped already
    except OSError:
        await asyncio.sleep(timeout)
        return False
    try:
        if process_start(pid) != started:
            return True  # the pid names a later process: ours is gone
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def on_exit() -> None:  # a pidfd turns readable when its process exits
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(fd, on_exit)
        try:
            await asyncio.wait_for(exited, timeout)
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(fd)
        return True
    finally:
        os.close(fd)
