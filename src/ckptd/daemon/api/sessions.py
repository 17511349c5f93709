"""Peer identity: who is calling, learned from the kernel, not from the caller.

gRPC's Python server does not expose a unix socket's peer credentials, so the
daemon listens on a second unix socket beside the gRPC one (``<socket>.session``,
the same 0660 mode). A client connects there first; the daemon reads the
connection's ``SO_PEERCRED`` (pid, uid, gid, set by the kernel at ``connect``),
the process's supplementary groups from ``/proc``, and answers with a random
session token. The client sends the token as gRPC metadata on every call; the
servicer maps it back to the :class:`Peer`. The session lives exactly as long as
that connection: when the process exits, the kernel closes it and the token dies
with it, so a token cannot outlive the process it was issued to.

A session also keeps the leases of its process: when the last session of a
process closes, the daemon waits for that process to exit (a pidfd, checked
against the process start time recorded when the session opened, so a reused
pid is not mistaken for it) and then takes back the leases it was granted and
never committed; a process that lives on without a session loses them after
``lease_timeout_seconds``. No file another user could lock keeps them.

Each uid may hold at most ``sessions_per_uid`` sessions (operators are not
counted), so one user cannot take every slot of the daemon's session limit.

The same connection carries file descriptors back (``SCM_RIGHTS``): the memory of
a lease and the files of a restore are opened by the daemon and handed to the one
process they were granted to, so the segments can stay 0600 and nobody else can
open them by name (:mod:`ckptd.daemon.api.access` decides).

Wire format: one JSON object per line each way. The first line from the daemon
is ``{"session": TOKEN, "uid": U, "pid": P}``; then each request
(``{"op": "lease", "lease_id": ...}`` or ``{"op": "file", "path": ...}``) gets one
answer: ``{"ok": true}`` with the descriptor attached, or
``{"error": STATUS_NAME, "message": ...}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import secrets
import socket
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.core.errors import CkptdError
from ckptd.core.session import MAX_LINE, session_path

from ..local.liveness import process_start, wait_gone

log = logging.getLogger("ckptd.sessions")


def session_limit() -> int:
    """Sessions open at once: a quarter of the fd limit (raised to its hard limit at
    start-up, serve.py), so callers opening connections cannot exhaust the daemon's
    descriptors for its own files."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, soft // 4)


Opener = Callable[["Peer", dict[str, Any]], int]


@dataclass(frozen=True)
class Peer:
    """The process on the other end of a session, as the kernel reported it."""

    uid: int
    gid: int
    groups: frozenset[int]
    """Primary and supplementary groups (read from /proc when the session opened)."""
    pid: int
    token: str
    started: int | None = None
    """The process's start time (``/proc/<pid>/stat``), to tell it from a reused pid."""

    @property
    def process(self) -> tuple[int, int]:
        """``(uid, pid)``: what a lease is bound to."""
        return (self.uid, self.pid)


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of a connected unix socket's peer, from the kernel."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def process_groups(pid: int, uid: int, gid: int) -> frozenset[int]:
    """The groups of process ``pid``; only the primary group if /proc disagrees on the
    uid (the pid was reused) or cannot be read."""
    groups = {gid}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return frozenset(groups)
    real_uids = fields.get("Uid", "").split()
    if not real_uids or int(real_uids[1]) != uid:  # effective uid, as SO_PEERCRED has it
        return frozenset(groups)
    groups.update(int(g) for g in fields.get("Groups", "").split())
    return frozenset(groups)


class SessionServer:
    """Accepts session connections, issues tokens, hands descriptors to their peers."""

    def __init__(
        self,
        socket_path: Path,
        openers: dict[str, Opener],
        on_close: Callable[[str], None] = lambda token: None,
        on_process_gone: Callable[[tuple[int, int]], None] = lambda process: None,
        idle_seconds: float = 600.0,
        per_uid: int = 0,
        exempt: frozenset[int] = frozenset(),
    ) -> None:
        """``on_process_gone(process)``: the last session of ``(uid, pid)`` closed and
        the process exited, or opened no session again within ``idle_seconds``.
        ``per_uid``: sessions one uid may hold (0: three quarters of the limit);
        uids in ``exempt`` (operators) are not counted."""
        self.path = Path(session_path(str(socket_path)))
        self.openers = openers
        self.on_close = on_close
        self.on_process_gone = on_process_gone
        self.idle_seconds = idle_seconds
        self.sessions: dict[str, Peer] = {}
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._watchers: dict[tuple[int, int], asyncio.Task[None]] = {}
        """One per process whose sessions all closed: waits for its exit."""
        self._left_at: dict[tuple[int, int], float] = {}
        self._accepting: asyncio.Task[None] | None = None
        self.max_sessions = session_limit()
        # A reserve of a quarter stays for the other users of a shared node.
        self.per_uid = per_uid or max(1, self.max_sessions * 3 // 4)
        self.exempt = exempt
        self._of_uid: Counter[int] = Counter()
        self._of_process: Counter[tuple[int, int]] = Counter()

    def peer(self, token: str) -> Peer | None:
        """The live session with this token, or None."""
        return self.sessions.get(token)

    async def start(self, group: int = -1) -> None:
        """Listen (mode 0660, group ``group`` if not -1) and accept in the background."""
        self.path.unlink(missing_ok=True)  # the caller holds the socket lock: stale
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o117)  # born 0660, never briefly wider
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o660)
        if group >= 0:
            os.chown(self.path, -1, group)
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def stop(self) -> None:
        """Stop accepting and close every session."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        for task in [*self._tasks, *self._watchers.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._watchers.values(), return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
        self.path.unlink(missing_ok=True)

    async def _accept(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            conn.setblocking(False)
            refusal = self._refusal(conn)
            if refusal:
                log.warning("refusing a session: %s", refusal)
                with contextlib.suppress(OSError):  # a fresh socket's buffer takes it
                    conn.send(json.dumps(_error("RESOURCE_EXHAUSTED", refusal)).encode() + b"\n")
                conn.close()
                continue
            task = loop.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        token = ""
        try:
            pid, uid, gid = peer_credentials(conn)
            token = secrets.token_urlsafe(24)
            peer = Peer(uid, gid, process_groups(pid, uid, gid), pid, token, process_start(pid))
            self.sessions[token] = peer
            self._of_uid[uid] += 1
            self._of_process[peer.process] += 1
            await _send(conn, {"session": token, "uid": uid, "pid": pid})
            buf = b""
            while True:
                chunk = await loop.sock_recv(conn, MAX_LINE)
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    await self._answer(conn, peer, line)
                if len(buf) > MAX_LINE:
                    log.warning("closing session of pid %d: request over %d bytes", pid, MAX_LINE)
                    return
        except (ConnectionError, OSError) as exc:
            log.debug("session closed: %s", exc)
        finally:
            peer_gone = self.sessions.pop(token, None)
            if peer_gone is not None:
                self._closed(peer_gone)
                self.on_close(token)
            conn.close()

    def _refusal(self, conn: socket.socket) -> str:
        """Why a new connection gets no session (empty: it gets one). Never names
        another user or their jobs."""
        if len(self._tasks) >= self.max_sessions:
            return (
                f"the daemon has {len(self._tasks)} sessions open, its limit (a quarter of "
                "its file descriptor limit); close clients you no longer use, or retry later"
            )
        try:
            _, uid, _ = peer_credentials(conn)
        except OSError:
            return ""  # the session itself fails and says why
        if uid not in self.exempt and self._of_uid[uid] >= self.per_uid:
            return (
                f"uid {uid} holds {self._of_uid[uid]} ckptd sessions, the most one user may "
                f"(sessions_per_uid = {self.per_uid}); close clients you no longer use (each "
                "Client holds one until close()), or ask the operator to raise "
                "sessions_per_uid in the ckptd config"
            )
        return ""

    def _closed(self, peer: Peer) -> None:
        """Count a session gone; the last of its process starts the wait for its exit."""
        self._of_uid[peer.uid] -= 1
        if self._of_uid[peer.uid] <= 0:
            del self._of_uid[peer.uid]
        self._of_process[peer.process] -= 1
        if self._of_process[peer.process] > 0:
            return
        del self._of_process[peer.process]
        loop = asyncio.get_running_loop()
        self._left_at[peer.process] = loop.time()
        if peer.process in self._watchers:  # one watcher per process, however often it leaves
            return
        task = loop.create_task(self._after_last(peer))
        self._watchers[peer.process] = task
        task.add_done_callback(lambda _: self._watchers.pop(peer.process, None))

    async def _after_last(self, peer: Peer) -> None:
        loop = asyncio.get_running_loop()
        wait = self.idle_seconds
        while not await wait_gone(peer.pid, peer.started, wait):
            if self._of_process[peer.process]:
                return  # it has a session again: its next leaving starts a new wait
            # Still running without a session: away idle_seconds since it last left?
            wait = self._left_at[peer.process] + self.idle_seconds - loop.time()
            if wait <= 0:
                break
        self._left_at.pop(peer.process, None)
        if self._of_process[peer.process] == 0:  # it opened no session since
            self.on_process_gone(peer.process)

    async def _answer(self, conn: socket.socket, peer: Peer, line: bytes) -> None:
        fd = -1
        try:
            request = json.loads(line)
            if not isinstance(request, dict) or request.get("op") not in self.openers:
                raise ValueError(f"unknown request; use one of {sorted(self.openers)}")
            fd = self.openers[request["op"]](peer, request)
            await _send(conn, {"ok": True}, fd)
        except CkptdError as exc:
            await _send(conn, _error(exc.status.name, str(exc)))
        except (ValueError, TypeError) as exc:
            await _send(conn, {"error": "INVALID_ARGUMENT", "message": f"bad request: {exc}"})
        except OSError as exc:
            await _send(conn, {"error": "NOT_FOUND", "message": f"cannot open: {exc.strerror}"})
        finally:
            if fd >= 0:
                os.close(fd)  # the peer has its own copy now


def _error(status: str, message: str) -> dict[str, Any]:
    return {"error": status, "message": message}


async def _send(conn: socket.socket, message: dict[str, Any], fd: int = -1) -> None:
    data = json.dumps(message).encode() + b"\n"
    loop = asyncio.get_running_loop()
    if fd < 0:
        await loop.sock_sendall(conn, data)
        return
    while True:
        try:
            sent = socket.send_fds(conn, [data], [fd])
            if sent < len(data):  # the descriptor went with the first byte
                await loop.sock_sendall(conn, data[sent:])
            return
        except BlockingIOError:
            ready = loop.create_future()
            loop.add_writer(conn.fileno(), ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_writer(conn.fileno())
