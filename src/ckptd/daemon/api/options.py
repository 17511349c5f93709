"""The wire API's settings: a typed, frozen group the composition root builds from
the daemon's configuration, so the API floor never reads the configuration itself."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """What the wire API (its sockets, sessions and access) is configured with beyond
    the socket's path; each field names its configuration key."""

    socket_group: int = -1
    """``socket_group``: the group given the sockets and their directory; -1: none."""
    sharing: Sharing = field(default_factory=Sharing)
    """``allow_uids``, ``allow_gids``, ``shared_jobs``."""
    sessions_per_uid: int = 0
    """``sessions_per_uid``: sessions one uid may hold (0: three quarters of the limit)."""
    session_idle_seconds: float = 600.0
    """``lease_timeout_seconds``: a process with leases and no session loses them then."""
