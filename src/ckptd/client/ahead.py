"""Work done ahead of the saves that would otherwise pay for it in the trainer's time.

A process's first save used to take 3-30x a steady one. Three costs were in it, each
once per process: the import of the leaf converters' modules (``ml_dtypes`` for torch
tensors: 0.1-2 s), the daemon making a segment of fresh memory (page by page, the
slowest memory on a VM that hands freed memory back), and mapping it here. With the
memory tier on, the second save paid the last two again: the first one's segment
stays in the tier, so the second needs another.

- :func:`warm_imports`, on a thread when a client is made: the converters' modules
  of the frameworks the program has imported.
- :class:`Reserver`: once the state's size is known (declared with
  ``Client.reserve(tree)`` before the first save; learnt from a restore of the
  process's own rank, as a restarted trainer's first call; after the first save
  for the second), the segments those saves will be granted are asked for on a thread,
  mapped (handoff.py keeps the mapping for the saves granted those segments, until
  two saves have been) and given back at once: they wait free in the daemon's
  pool, faulted in. No lease is held between saves, so nothing can expire or hold
  the budget from other jobs, and a reservation never makes the daemon let go of
  what its memory tier keeps (``AcquireLeaseRequest.reserve``: free room only).
  A save that asks for its lease itself (the first of a process: no early lease)
  waits for a reservation in flight (:meth:`Reserver.acquire`).
"""

from __future__ import annotations

import importlib
import logging
import mmap
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait

from ckptd.core.errors import CkptdError
from ckptd.proto import ckptd_pb2 as pb

from .handoff import PREMAPPED, Handoff, lease_size

log = logging.getLogger("ckptd.client")

_CONVERTERS = {"torch": "ckptd.client.leaves.torch_tensors"}
"""The module a framework's arrays need, imported when the program imported it."""


def warm_imports() -> threading.Thread | None:
    """Import the converters of the frameworks already imported, on a daemon thread
    (a save that needs one meanwhile waits for the same import, no longer)."""
    names = [module for framework, module in _CONVERTERS.items() if framework in sys.modules]
    if not names:
        return None

    def run() -> None:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # the save that needs it raises the error, with context
                log.debug("could not import %s ahead of the first save", name, exc_info=True)

    thread = threading.Thread(target=run, name="ckptd-imports", daemon=True)
    thread.start()
    return thread


class Reserver:
    """Segments of a size made and mapped ahead of the saves that take them."""

    def __init__(self, handoff: Handoff, rank: int, executor: Executor) -> None:
        self.handoff = handoff
        self.rank = rank
        self.executor = executor
        self._memory_tier: bool | None = None  # asked once
        self.size: int | None = None
        """The lease size the first saves take, once known: declared, restored, saved."""
        self._asked: Future[int] | None = None  # the last reservation asked for

    def first_saves(self, size: int) -> Future[int]:
        """The first saves' segments of ``size`` bytes made ahead: the state's size
        declared (``Client.reserve``) or learnt from a restore of this rank."""
        self.size = size
        return self.reserve(size)

    def restored(self, data_len: Callable[[], int]) -> None:
        """This rank restored a step of ``data_len()`` bytes: the first saves, likely of
        its size (a restarted trainer saves what it restored), have their segments made
        ahead unless a save or a reservation told the size first."""
        if self.size is None:
            self.first_saves(lease_size(data_len()))

    def after_first(self, size: int) -> None:
        """The first save handed off (``size`` bytes): the second's segment made ahead
        unless the first saves' were, of this size."""
        if size != self.size:
            self.second(size)
        self.size = size

    def reserve(self, size: int, count: int | None = None, tier_only: bool = False) -> Future[int]:
        """Have ``count`` segments of ``size`` bytes made and mapped (None: as many as
        a process's first saves take: two with the memory tier on, one without;
        ``tier_only``: none without it); resolves to the number made ready."""
        self._asked = self.executor.submit(self._run, size, count, tier_only)
        return self._asked

    def acquire(
        self, size: int, wait_s: float, what: str, reuse_image: bool
    ) -> tuple[pb.Lease, mmap.mmap]:
        """A save's own lease, mapped (Handoff.acquire), once the reservation asked for
        before it is done: a save that overtook it (the first after a restore) would
        have a segment made in its blocking time while the reservation had the one
        meant for it made too, one segment too many for good."""
        if self._asked is not None:
            wait([self._asked])
        return self.handoff.acquire(size, wait_s, what, self.rank, reuse_image)

    def second(self, size: int) -> Future[int]:
        """After the first save: the second save's segment, with the memory tier on
        (without it the first one's comes back; another would stay one too many)."""
        return self.reserve(size, 1, tier_only=True)

    def memory_tier(self) -> bool:
        """Whether the daemon keeps saves in its memory tier (asked once)."""
        if self._memory_tier is None:
            try:
                status = self.handoff.connection.get_status(pb.GetStatusRequest())
            except CkptdError:
                return False  # asked again next time
            self._memory_tier = status.memory_tier_steps > 0
        return self._memory_tier

    def _run(self, size: int, count: int | None, tier_only: bool) -> int:
        leases: list[pb.Lease] = []
        ready = 0
        try:
            tier = self.memory_tier()
            if tier_only and not tier:
                return 0
            # Held until all are mapped: given back one by one, the next would be granted
            # the same free segment. Asked once each, never retried: a daemon that does
            # not answer now gets the saves' own requests.
            for _ in range(min(PREMAPPED, count or (2 if tier else 1))):
                req = pb.AcquireLeaseRequest(
                    job=self.handoff.job, size_bytes=size, rank=self.rank, reserve=True
                )
                conn = self.handoff.connection
                leases.append(conn.acquire_lease(req, None, self.handoff.liveness.metadata()))
                self.handoff.premap(leases[-1])
                ready += 1
        except Exception as exc:  # best effort: the saves ask for their own
            log.debug("reserved no more staging memory ahead of the saves: %s", exc)
        finally:
            for lease in leases:
                self.handoff.release(lease.lease_id)
        return ready
