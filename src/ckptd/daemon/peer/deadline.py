"""Whole-request deadlines for the bulk listener's blocking sockets.

A socket timeout bounds one ``recv`` or ``send``: a caller that trickles a byte
just inside it holds its connection (and the thread and transfer slot behind it)
for ever. :class:`Watchdog` shuts a socket down once its deadline passes whatever
it is doing, which wakes the thread blocked on it (``recv`` returns nothing,
``send`` fails): one thread for every connection, not a timer each. It holds a
duplicate of the socket's descriptor: a TLS wrapper takes the original's over,
and a number closed and reused by another connection is never shut down.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time


class Watchdog:
    """Shuts sockets down at their deadlines (one thread, started on first use)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._due: dict[int, tuple[float, socket.socket]] = {}
        self._keys = itertools.count(1)
        self._thread: threading.Thread | None = None
        self.fired = 0
        """Sockets shut down at their deadline (status, tests)."""

    def arm(self, sock: socket.socket, seconds: float) -> int:
        """Shut ``sock`` down in ``seconds`` unless :meth:`disarm` comes first; the key
        to disarm it with."""
        own = socket.socket(fileno=os.dup(sock.fileno()))  # an SSLSocket has no dup()
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            key = next(self._keys)
            self._due[key] = (time.monotonic() + seconds, own)
            self._cond.notify()
        return key

    def disarm(self, key: int) -> bool:
        """Forget a deadline; False if it passed already (the socket is shut down)."""
        with self._cond:
            entry = self._due.pop(key, None)
        if entry is None:
            return False
        entry[1].close()
        return True

    def fire(self, key: int) -> None:
        """Shut the socket down now (its deadline brought forward)."""
        with self._cond:
            entry = self._due.get(key)
            if entry is not None:
                self._due[key] = (0.0, entry[1])
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for key in [k for k, (at, _) in self._due.items() if at <= now]:
                    _, sock = self._due.pop(key)
                    self.fired += 1
                    with contextlib.suppress(OSError):  # the peer closed meanwhile
                        sock.shutdown(socket.SHUT_RDWR)
                    sock.close()
                soonest = min((at for at, _ in self._due.values()), default=None)
                self._cond.wait(None if soonest is None else max(soonest - now, 0.0))
