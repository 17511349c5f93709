"""The catalog's event log and waits: every transition emits one :class:`Event`, kept
for ``ListEvents`` and handed to the subscribers (metrics, drain, evictor, peer tier).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from ckptd.core.names import check_wait

from .step import Event, Step

log = logging.getLogger("ckptd.catalog")

MAX_WAIT_SECONDS = 3600.0
HISTORY = 8192
"""Events kept for ``ListEvents`` (older ones are dropped; their seq numbers stay counted)."""

Listener = Callable[[Event], None]
_Events = list[Event]


class EventLog:
    """The events of the steps' transitions (the :class:`Catalog` emits them)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._monotonic = monotonic
        self._listeners: list[Listener] = []
        self._free_listeners: list[Callable[[Step], None]] = []
        self._history: collections.deque[Event] = collections.deque(maxlen=HISTORY)
        self._seq = 0
        self._appended = asyncio.Event()
        self.stopping = asyncio.Event()
        """Set when the daemon stops: waits return at once (the client asks again)."""

    # -- events ------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(event)`` after every transition (on the loop; keep it short)."""
        self._listeners.append(listener)

    def on_free(self, listener: Callable[[Step], None]) -> None:
        """Call ``listener(step)`` when nothing reads a step's copy any more (the last
        ``in_use`` ended): work that passed it over while it was read looks again."""
        self._free_listeners.append(listener)

    def _freed(self, st: Step) -> None:
        for listener in self._free_listeners:
            listener(st)

    def events(self, after: int = 0, job: str = "", limit: int = HISTORY) -> _Events:
        """Events with ``seq > after`` still in the history, oldest first."""
        rows = [e for e in self._history if e.seq > after and (not job or e.job == job)]
        return rows[:limit]

    @property
    def last_seq(self) -> int:
        """The newest event's sequence number (0: none yet)."""
        return self._seq

    async def wait_for_event(self, after: int, job: str, timeout: float) -> None:
        """Return once an event newer than ``after`` (of ``job``, if given) exists, the
        daemon stops, or ``timeout`` passes."""
        deadline = self._monotonic() + check_wait("wait_seconds", timeout, MAX_WAIT_SECONDS)
        while not self.events(after, job, 1) and not self.stopping.is_set():
            left = deadline - self._monotonic()
            if left <= 0:
                return
            await self._either(self._appended, left)

    def _emit(self, st: Step, kind: int, detail: str = "", **attributes: str) -> Event:
        self._seq += 1
        event = Event(
            self._seq,
            self._clock(),
            kind,
            st.job,
            st.step,
            st.state,
            tuple(st.tiers()),
            detail,
            attributes,
        )
        self._history.append(event)
        st.changed.set()
        st._set(changed=asyncio.Event())
        self._appended.set()
        self._appended = asyncio.Event()
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # a listener's bug must not break a transition
                log.exception("catalog listener %r failed on %s", listener, event)
        return event

    async def _either(self, event: asyncio.Event, timeout: float) -> None:
        """Wait until ``event`` or :attr:`stopping` is set, at most ``timeout`` seconds."""
        changed = asyncio.ensure_future(event.wait())
        stopping = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait((changed, stopping), timeout=timeout, return_when="FIRST_COMPLETED")
        changed.cancel()
        stopping.cancel()
