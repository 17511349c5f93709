"""Room for a lease: who lets shared memory go when staging is short of it.

Staging (the lease pool, staging.py) and the memory tier (memory.py) need each other:
the memory tier keeps its copies in staging's segments, and staging asks it to let
some go when a save or restore finds no room (saves first). The ask is a small
protocol, :class:`MakesRoom`. A :class:`Room` is built first and handed to both at
construction: staging asks it, the memory tier serves it. No service assigns onto
another, and the structure drawing shows both arrows.
"""

from __future__ import annotations

from typing import Protocol


class MakesRoom(Protocol):
    """What staging asks of the holder of kept segments (the memory tier)."""

    async def give_way(self, need: int, uid: int | None) -> None:
        """Let kept segments go until a lease of ``need`` bytes for ``uid`` fits the
        staging budget (a save never waits or fails because of them)."""

    async def shed(self, need: int) -> bool:
        """The shm filesystem cannot hold a new segment: let at least ``need`` bytes
        go; False if nothing was held."""

    def grows_with(self, job: str, size: int) -> bool:
        """Whether a save of ``job`` of ``size`` bytes, once in, is kept as one segment
        more (staging begins the next save's spare at once: spares.py)."""


class Room:
    """The one place staging's ask for room is answered: by nobody (no memory tier),
    or by the one service that :meth:`serve` named."""

    def __init__(self) -> None:
        self._by: MakesRoom | None = None

    def serve(self, by: MakesRoom) -> None:
        """``by`` answers from now on (its constructor calls this); one answers."""
        if self._by is not None and self._by is not by:
            raise RuntimeError("room is already made by another service")
        self._by = by

    async def give_way(self, need: int, uid: int | None) -> None:
        """:meth:`MakesRoom.give_way` of the serving service; nothing without one."""
        if self._by is not None:
            await self._by.give_way(need, uid)

    async def shed(self, need: int) -> bool:
        """:meth:`MakesRoom.shed` of the serving service; False without one."""
        return await self._by.shed(need) if self._by is not None else False

    def grows_with(self, job: str, size: int) -> bool:
        """:meth:`MakesRoom.grows_with` of the serving service; False without one."""
        return self._by.grows_with(job, size) if self._by is not None else False
