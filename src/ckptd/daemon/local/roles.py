"""The staging pool as each service sees it: narrow interfaces by role.

Staging (staging.py over lending.py and pool.py) owns the node's shared memory: the
segments, who holds each (segment_state.py), the budget. A service is handed only
the role it plays, checked by mypy:

- :class:`Budget`: how much is held and whether a save would fit (admission).
- :class:`Leases`: leases granted, held, handed off and given back, and a crashed
  daemon's handoffs taken over (the save path and its replay, the restore tiers,
  the restorer).
- :class:`Keeping`: the memory tier's side: committed segments kept, shared with a
  restore, let go, taken back after a restart.

``Staging`` is all of them; the composition root (app/compose.py) hands it out, and
the API (servicer, access) and start-up keep the whole pool.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from .lease import Lease, Segment


class Budget(Protocol):
    """How much shared memory is held, and whether a save would fit."""

    budget_bytes: int

    @property
    def in_use_bytes(self) -> int: ...
    @property
    def committed_bytes(self) -> int: ...
    @property
    def allocated_bytes(self) -> int: ...
    def could_grant(self, size_bytes: int) -> bool: ...
    def check_fits(self, size_bytes: int) -> int: ...


class Leases(Protocol):
    """Leases granted, held by their client, handed off and given back."""

    budget_bytes: int
    shm_dir: Path

    @property
    def allocated_bytes(self) -> int: ...
    @property
    def dir(self) -> Path: ...
    async def acquire(
        self,
        job: str,
        size_bytes: int,
        restore: bool = False,
        wait_seconds: float = 0.0,
        holder: str = "",
        owner: tuple[int, int] | None = None,
        populate: bool = True,
        image: tuple[str, int] | None = None,
        reserve: bool = False,
    ) -> Lease: ...
    def take_free(self, job: str, size_bytes: int, uid: int | None = None) -> Lease | None: ...
    def get(self, lease_id: str) -> Lease: ...
    def hold(self, lease: Lease, holder: str, owner: tuple[int, int] | None) -> bool: ...
    def holds(self, lease: Lease) -> bool: ...
    def begin_commit(self, lease_id: str) -> Lease: ...
    def release(self, lease_id: str) -> None: ...
    def adopt(self, name: str, lease_id: str, job: str, size: int | None = None) -> Lease: ...


class Keeping(Protocol):
    """The memory tier's side of the pool."""

    budget_bytes: int
    uid_of: Callable[[str], int | None]

    @property
    def allocated_bytes(self) -> int: ...
    @property
    def dir(self) -> Path: ...
    def path_of(self, seg: Segment) -> Path: ...
    def free_segments(self) -> list[Segment]: ...
    def keep(self, lease: Lease, key: tuple[str, int, int]) -> bool: ...
    def grant_kept(self, job: str, seg: Segment) -> Lease: ...
    def let_go(self, seg: Segment) -> None: ...
    def adopt_kept(
        self, name: str, size: int, uid: int | None, key: tuple[str, int, int]
    ) -> Segment: ...
