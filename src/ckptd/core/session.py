"""The client's session with a daemon: who this process is, proven by the kernel.

See :mod:`ckptd.daemon.api.sessions` for the daemon side. A :class:`Session`
connects to ``<socket>.session`` once per process (again after a fork or a
daemon restart), keeps the connection open for the process's life, and sends
the token it got as the ``ckptd-session`` metadata of every gRPC call. Lease
memory and restore files the process may not open by name come back over the
same connection as file descriptors.
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
from typing import Any

import grpc

from .errors import CkptdError, Unavailable, from_status

SESSION_HEADER = "ckptd-session"
"""gRPC metadata carrying the session token."""
MAX_LINE = 64 * 1024


def session_path(socket_path: str) -> str:
    """The session socket beside gRPC socket ``socket_path``."""
    return socket_path + ".session"


def open_readable(session: Session, path: str) -> int:
    """A read-only descriptor of ``path``: opened here if this user may, else handed
    over by the daemon (a file of a restore it answered to this process)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError:
        return session.open_file(path)


class Session:
    """This process's session with the daemon at ``socket_path`` (thread-safe)."""

    def __init__(self, socket_path: str, timeout: float = 30.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.token = ""
        self.uid = -1
        self._sock: socket.socket | None = None
        self._pid = 0
        self._buf = b""
        self._lock = threading.Lock()

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The header to send; opens (or reopens) the session if needed."""
        with self._lock:
            self._ensure()
            return ((SESSION_HEADER, self.token),)

    def reset(self) -> None:
        """Forget the session (the daemon restarted or no longer knows the token)."""
        with self._lock:
            self._close()

    def open_lease(self, lease_id: str) -> int:
        """A descriptor of the shared memory of ``lease_id`` (granted to this process)."""
        return self._request({"op": "lease", "lease_id": lease_id})

    def open_file(self, path: str) -> int:
        """A read-only descriptor of ``path``, a file the daemon handed us for a restore."""
        return self._request({"op": "file", "path": path})

    def close(self) -> None:
        """End the session."""
        self.reset()

    # -- internals -------------------------------------------------------------
    def _ensure(self) -> None:
        if self._sock is not None and self._pid == os.getpid() and not self._closed_by_peer():
            return
        self._close()  # a fork's copy is the parent's session, not ours
        path = session_path(self.socket_path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(path)
            hello = self._read_line(sock)
        except OSError as exc:
            sock.close()
            raise Unavailable(
                f"cannot reach the ckptd daemon at {self.socket_path} (its session socket "
                f"{path}: {exc.strerror or exc}): is `ckptd serve` running there, and is this "
                "user in the socket's group? (set CKPTD_SOCKET or pass socket=...)"
            ) from None
        if "error" in hello:  # refused (too many sessions): the daemon says what to do
            sock.close()
            raise from_status(grpc.StatusCode[hello["error"]], str(hello.get("message", "")))
        self._sock, self._pid = sock, os.getpid()
        self.token, self.uid = str(hello["session"]), int(hello["uid"])

    def _closed_by_peer(self) -> bool:
        """The daemon went away (EOF is readable) since the last call."""
        assert self._sock is not None
        readable, _, _ = select.select([self._sock], [], [], 0)
        return bool(readable)

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self.token, self._buf = None, "", b""

    def _request(self, message: dict[str, Any]) -> int:
        with self._lock:
            self._ensure()
            assert self._sock is not None
            try:
                self._sock.sendall(json.dumps(message).encode() + b"\n")
                answer, fd = self._read_answer(self._sock)
            except OSError as exc:
                self._close()
                raise Unavailable(f"the ckptd session broke: {exc}") from None
        if "error" in answer:
            if fd >= 0:
                os.close(fd)
            raise from_status(grpc.StatusCode[answer["error"]], str(answer.get("message", "")))
        if fd < 0:
            raise CkptdError("the daemon answered without a file descriptor")
        return fd

    def _read_answer(self, sock: socket.socket) -> tuple[dict[str, Any], int]:
        fd = -1
        while b"\n" not in self._buf:
            data, fds, _, _ = socket.recv_fds(sock, MAX_LINE, 1)
            if not data:
                raise ConnectionError("the daemon closed the session")
            if fds:
                fd = fds[0]
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line), fd

    def _read_line(self, sock: socket.socket) -> dict[str, Any]:
        answer, fd = self._read_answer(sock)
        if fd >= 0:
            os.close(fd)
        return answer
