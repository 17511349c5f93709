"""The wire API's configuration keys, declared here once (see local/options.py):
who may reach the socket and use whose jobs. The socket's path is the
application's (app/options.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sharing:
    """Who besides a job's owner may use it (access.py); nothing set: its owner only."""

    allow_uids: tuple[int, ...] = ()
    """``allow_uids``: users who may use every job."""
    allow_gids: tuple[int, ...] = ()
    """``allow_gids``: members of these groups may use every job."""
    shared_jobs: tuple[str, ...] = ()
    """``shared_jobs``: job patterns anyone who reaches the socket may use."""

    @property
    def any(self) -> bool:
        """Whether the operator lets users other than a job's owner use it."""
        return bool(self.allow_uids or self.allow_gids or self.shared_jobs)


@dataclass(frozen=True)
class ApiOptions:
    """What the wire API (its sockets, sessions and access) is configured with."""

    socket_group: str = ""
    """Group (name or gid) given to the socket, its session socket and its directory:
    the users who may call the daemon. Empty: the daemon's own group."""
    allow_uids: tuple[int, ...] = ()
    """Users (uids or names) who may use every job; a job otherwise belongs to the uid
    that first used it (root and the daemon's uid may use every job)."""
    allow_gids: tuple[int, ...] = ()
    """Groups (gids or names) whose members may use every job."""
    shared_jobs: tuple[str, ...] = ()
    """Job name patterns (fnmatch: ``team-*``) that anyone who reaches the socket may use."""
    sessions_per_uid: int = 0
    """Sessions (connected clients) one uid may hold at once; root and the daemon's
    uid are not counted. 0: three quarters of the daemon's session limit (a quarter
    of its fd limit), so one user cannot take every slot from the others while a
    single-user node keeps room for all its clients."""

    @property
    def sharing(self) -> Sharing:
        """``allow_uids``, ``allow_gids`` and ``shared_jobs`` together."""
        return Sharing(self.allow_uids, self.allow_gids, self.shared_jobs)

    @property
    def socket_gid(self) -> int:
        """``socket_group`` as a gid (names are resolved when the key is read); -1: none."""
        return int(self.socket_group) if self.socket_group else -1
