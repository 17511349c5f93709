"""Every name made and removed in one directory, in order, through inotify: a file
that exists only between two looks of a poll (made and removed at once) is seen.

Used to check that the daemon's segment directory never holds more than the
staging budget, whatever happens between the test's own synchronisation points.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import threading
from collections.abc import Callable
from pathlib import Path

_IN_MOVED_FROM = 0x40
_IN_MOVED_TO = 0x80
_IN_CREATE = 0x100
_IN_DELETE = 0x200
_IN_DELETE_SELF = 0x400
_IN_IGNORED = 0x8000
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)

_libc = ctypes.CDLL(None, use_errno=True)


class DirWatch:
    """Watches ``path`` from construction until :meth:`stop` (or the directory is
    removed): :attr:`most` is the largest number of names ``counts`` accepts that
    were there at once, :attr:`made` every such name made, in order."""

    def __init__(self, path: Path, counts: Callable[[str], bool] = lambda name: True) -> None:
        self._counts = counts
        self._fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        mask = _IN_CREATE | _IN_DELETE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_DELETE_SELF
        if _libc.inotify_add_watch(self._fd, os.fsencode(path), mask) < 0:
            err = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(err, f"cannot watch {path}")
        # Listed after the watch is set: a name made in between is both here and in an
        # event, which adds it once; one made and removed in between only in events.
        self.names = {p.name for p in path.iterdir() if counts(p.name)}
        self.most = len(self.names)
        self.made: list[str] = []
        self.removed = False
        """The directory itself was removed (the watch ended with it)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dir-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poll = select.poll()
        poll.register(self._fd, select.POLLIN)
        while not self.removed:
            if not poll.poll(50):
                if self._stop.is_set():
                    return  # nothing queued and asked to stop: every event was read
                continue
            data = os.read(self._fd, 1 << 16)
            at = 0
            while at < len(data):
                _, mask, _, size = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size : at + _EVENT.size + size].rstrip(b"\0").decode()
                at += _EVENT.size + size
                self._event(mask, name)

    def _event(self, mask: int, name: str) -> None:
        if mask & (_IN_DELETE_SELF | _IN_IGNORED):
            self.removed = True
        elif mask & (_IN_CREATE | _IN_MOVED_TO) and self._counts(name):
            self.names.add(name)
            self.made.append(name)
            self.most = max(self.most, len(self.names))
        elif mask & (_IN_DELETE | _IN_MOVED_FROM):
            self.names.discard(name)

    def stop(self) -> None:
        """Read every event queued so far, then stop watching."""
        self._stop.set()
        self._thread.join(30)
        os.close(self._fd)
