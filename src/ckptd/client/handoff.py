"""Leases and commits of one client, riding out restarts of the daemon.

The trainer must survive its sidecar: while the daemon is unreachable, a save
keeps trying for ``reconnect_timeout`` seconds and then raises
:class:`CkptdUnavailable` saying what to do. A client that never reached a daemon
has nothing to wait for (a wrong socket, no ``ckptd serve``): it gives up after
``connect_timeout`` seconds and says how to start one. A commit whose answer was lost (the
daemon died after journaling it, or before) is sent again; its bytes are copied
from the old segment, which this process still maps even after the daemon
removed its name, so the caller's arrays are never read again after
:meth:`Client.save` returned. A commit the daemon already journaled comes back
as a conflict on the retry and counts as done.

The liveness file: a small file in the shm directory on which this process
holds a shared flock for its whole life. Its name goes with every lease
request, and the daemon takes a lease back as soon as nobody holds that lock:
a trainer killed between lease and commit no longer pins memory for
``lease_timeout_seconds``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from ckptd.core.errors import CkptdUnavailable, Conflict, NotFound
from ckptd.core.format import COPIED_FAILED, COPIED_WORD, round_up
from ckptd.core.wire import Connection
from ckptd.proto import ckptd_pb2 as pb

from . import mapped_views

log = logging.getLogger("ckptd.client")

HOLDER_HEADER = "ckptd-holder"
"""gRPC metadata naming the liveness file (the daemon's staging.HOLDER_HEADER)."""
MAPPED_SEGMENTS = 4  # saves every step rotate through four; a re-map costs tens of ms
"""Segments kept mapped between saves (the daemon reuses them)."""
PREMAPPED = 2
"""Segments mapped ahead of saves (reserve): unmapped once that many did not take them."""
T = TypeVar("T")


def lease_size(data_len: int) -> int:
    """The lease a save of ``data_len`` bytes asks for: its data, then the word that
    says it is whole (:meth:`Handoff.commit_copying`)."""
    return round_up(data_len) + COPIED_WORD


@dataclass
class Copying:
    """A commit sent while its lease is still being filled (:meth:`Handoff.send_copying`).

    The word that says the lease is whole is written on the commit's thread once
    the copying thread said it is done (:attr:`copied`): the event orders every
    copied byte before the word for any other CPU too (a store of this thread
    after its own copy would not be, on a weakly ordered one), and the word is
    written whatever became of the commit, so no daemon that journaled it waits
    for a client that went on."""

    req: pb.CommitShardsRequest
    mm: mmap.mmap
    copied: threading.Event = field(default_factory=threading.Event)
    whole: bool = True
    answer: Future[None] | None = None
    marked: bool = False

    def mark_when_copied(self) -> None:
        """(The commit's thread.) Wait for the copy, then write the word, once."""
        self.copied.wait()
        if not self.marked:
            Handoff.mark(self.req, self.mm, self.whole)
            self.marked = True

    def done(self, whole: bool = True) -> None:
        """(The copying thread.) The copy is over (``whole``: it succeeded); wait until
        the daemon answered and the word is written, raising the commit's error if
        whole (else the copy's error is the one to raise)."""
        self.whole = whole
        self.copied.set()
        assert self.answer is not None
        if whole:
            self.answer.result()
        else:
            self.answer.exception()  # nothing may still use the lease once save() raised


class Liveness:
    """The liveness file of this process (created on first use, removed on close)."""

    def __init__(self) -> None:
        self._fd = -1
        self._pid = 0
        self.name = ""
        self._lock = threading.Lock()  # a lease may be asked for on a thread of its own

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The header naming the file; creates and locks it on first use (or after a fork)."""
        with self._lock:
            if self._fd < 0 or self._pid != os.getpid():
                self._create()
            return ((HOLDER_HEADER, self.name),)

    def _create(self) -> None:
        name = f"ckptd-client-{os.getpid()}-{secrets.token_hex(8)}"
        path = os.path.join(mapped_views.SHM_DIR, name)
        # Locked before it gets its name: the daemon tidies a liveness file nobody
        # locks, and then takes this client for gone.
        tmp = f"{path}.new"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDONLY, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._fd, self._pid, self.name = fd, os.getpid(), name

    def close(self) -> None:
        """Drop the lock and the file (only the process that made them)."""
        if self._fd >= 0 and self._pid == os.getpid():
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(mapped_views.SHM_DIR, self.name))
            os.close(self._fd)
        self._fd = -1


class Handoff:
    """Lease, copy and commit for one client; see the module docstring."""

    def __init__(
        self,
        connection: Connection,
        job: str,
        reconnect_timeout: float,
        connect_timeout: float,
    ) -> None:
        self.connection = connection
        self.job = job
        self.reconnect_timeout = reconnect_timeout
        self.connect_timeout = connect_timeout
        self.liveness = Liveness()
        self._segments: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._premapped: dict[str, mmap.mmap] = {}  # ahead.py's, for _map to take
        self._premap_saves = 0  # saves left to take them; then the rest are unmapped
        self._premap_lock = threading.Lock()
        self._warned = False
        self.unmapping: list[Callable[[mmap.mmap], None]] = []
        """Called with a segment's mapping before it is unmapped (a copier that
        registered it with a device driver lets go of it)."""

    def patience(self) -> float:
        """How long to keep trying while the daemon is unreachable: the reconnect
        timeout once a daemon answered (it is restarting), else the connect timeout."""
        return self.reconnect_timeout if self.connection.reached else self.connect_timeout

    def retrying(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, called again while the daemon is unreachable, up to :meth:`patience`."""
        since: float | None = None
        while True:
            try:
                result = fn()
            except CkptdUnavailable as exc:
                now = time.monotonic()
                since = now if since is None else since
                if now - since >= self.patience():
                    raise self._unreachable(what, now - since, exc) from None
                if not self._warned:
                    # str(exc), not exc: a logged exception keeps its traceback, and so
                    # this frame, alive in log handlers that store records, and with it
                    # the restored arrays this frame returns later.
                    log.warning("%s: daemon unreachable, retrying: %s", what, str(exc))
                    self._warned = True
                time.sleep(0.2)
                continue
            if self._warned:
                log.warning("the ckptd daemon is reachable again")
                self._warned = False
            return result

    def _unreachable(self, what: str, waited: float, exc: CkptdUnavailable) -> CkptdUnavailable:
        socket = self.connection.socket
        if not self.connection.reached:
            return CkptdUnavailable(
                f"{what}: no ckptd daemon answers at {socket} (tried for {waited:.0f} s; "
                "this client never reached one). Start one with `ckptd serve --root "
                f"/path/to/checkpoints --socket {socket}`, or point the client at the "
                "running one with Client(job, socket=...) or CKPTD_SOCKET. Last error: "
                f"{exc}"
            )
        return CkptdUnavailable(
            f"{what}: the ckptd daemon at {socket} has been unreachable for {waited:.0f} s "
            "(reconnect_timeout); check that the sidecar is running (`ckptd status`, its "
            f"logs); training can go on and save later. Last error: {exc}"
        )

    def acquire(
        self, size: int, wait: float, what: str, rank: int = 0, reuse_image: bool = False
    ) -> tuple[pb.Lease, mmap.mmap]:
        """A lease of ``size`` bytes, mapped: ``(lease, mapping)``. ``reuse_image``: rather
        the segment holding ``rank``'s last committed save (``lease.holds_image``)."""
        return self.map(self.request(size, wait, what, rank, reuse_image))

    def request(
        self, size: int, wait: float, what: str, rank: int = 0, reuse_image: bool = False
    ) -> pb.Lease:
        """A lease of ``size`` bytes, not yet mapped (any thread may ask for one; see
        :meth:`acquire`)."""

        def once() -> pb.Lease:
            req = pb.AcquireLeaseRequest(
                job=self.job, size_bytes=size, wait_seconds=wait, rank=rank, reuse_image=reuse_image
            )
            return self.connection.acquire_lease(
                req, wait + self.connection.timeout, self.liveness.metadata()
            )

        return self.retrying(what, once)

    def map(self, lease: pb.Lease) -> tuple[pb.Lease, mmap.mmap]:
        """``(lease, its mapping)``; the lease is given back if it cannot be mapped.
        Only on the thread that copies: mapping may unmap an older segment."""
        try:
            return lease, self._map(lease)
        except BaseException:
            self.release(lease.lease_id)
            raise

    def commit(
        self,
        req: pb.CommitShardsRequest,
        mm: mmap.mmap,
        size: int,
        what: str,
        copied: Callable[[], None] | None = None,
    ) -> None:
        """Commit ``req``; if the daemon went away meanwhile, copy the bytes into a new
        lease of the daemon that came back and commit again (after ``copied()``
        returns, for a commit sent while the lease is still being filled: it waits
        for the copy and writes the word, which the new lease gets too)."""
        lost = False
        renewed = 0
        since = time.monotonic()
        while True:
            try:
                self.connection.commit_shards(req)
                return
            except CkptdUnavailable:
                lost = True  # the daemon may or may not have journaled it
                if time.monotonic() - since >= self.reconnect_timeout:
                    raise
                self.retrying(what, lambda: self.connection.get_status(pb.GetStatusRequest()))
            except NotFound:
                renewed += 1
                if renewed > 3:
                    raise
                # A new daemon (a lease of a live client is never taken back otherwise):
                # the old lease is gone, its bytes are still in our mapping.
                if copied is not None:
                    copied()
                lease, new = self.acquire(size, 60.0, what)
                np.copyto(np.frombuffer(new, np.uint8, size), np.frombuffer(mm, np.uint8, size))
                req.lease_id, mm = lease.lease_id, new
            except Conflict:
                if lost and self._handed_off(req):
                    # The first try was journaled before its answer was lost; a lease
                    # taken for the retry is not needed (a committed one is refused).
                    self.release(req.lease_id)
                    return
                raise

    def commit_copying(
        self,
        req: pb.CommitShardsRequest,
        mm: mmap.mmap,
        size: int,
        what: str,
        copy: Callable[[], None],
        committer: Executor,
        word: bool = True,
    ) -> None:
        """``copy()`` the save's ``size`` bytes into the lease ``mm`` and commit ``req``:
        sent on ``committer`` while ``copy()`` runs where it may be
        (:meth:`send_copying`); returns once the daemon answered and the lease is whole."""
        sending = self.send_copying(req, mm, size, what, committer, word)
        self.commit_copied(sending, req, mm, size, what, copy)

    def send_copying(
        self,
        req: pb.CommitShardsRequest,
        mm: mmap.mmap,
        size: int,
        what: str,
        committer: Executor,
        word: bool,
    ) -> Copying | None:
        """Send ``req`` on ``committer`` before the lease is filled, where the daemon
        waits for the word (``word``: its lease said so) and the lease has room for it
        past the data (:func:`lease_size`); None where it must wait for the copy.

        The daemon journals and answers at once, and reads the lease only once the
        word written after the copy says it is whole (its ``local/copied.py``): the
        commit's round trip and the journal's fsync overlap the copy instead of
        following it. Finish with :meth:`commit_copied`."""
        if not word or len(mm) < size + COPIED_WORD:
            return None
        req.copied_at = size
        req.copied_nonce = secrets.randbits(63) | 1  # never its own complement
        sending = Copying(req, mm)

        def commit() -> None:
            try:
                self.commit(req, mm, size + COPIED_WORD, what, sending.mark_when_copied)
            finally:
                sending.mark_when_copied()

        sending.answer = committer.submit(commit)
        return sending

    def commit_copied(
        self,
        sending: Copying | None,
        req: pb.CommitShardsRequest,
        mm: mmap.mmap,
        size: int,
        what: str,
        copy: Callable[[], None],
    ) -> None:
        """``copy()``, then the word of the commit ``sending`` (or, None, the commit)."""
        if sending is None:
            copy()
            self.commit(req, mm, size, what)
            return
        try:
            copy()
        except BaseException:
            sending.done(whole=False)
            raise
        sending.done(whole=True)

    @staticmethod
    def mark(req: pb.CommitShardsRequest, mm: mmap.mmap, whole: bool = True) -> None:
        """Write the word of a commit sent while copying: the lease is whole (or the
        copy failed, and the daemon is to drop the save)."""
        word = req.copied_nonce if whole else req.copied_nonce ^ COPIED_FAILED
        mm[req.copied_at : req.copied_at + COPIED_WORD] = word.to_bytes(COPIED_WORD, "little")

    def _handed_off(self, req: pb.CommitShardsRequest) -> bool:
        status = self.connection.get_save_status(
            pb.GetSaveStatusRequest(job=req.job, step=req.step, timeout_seconds=0.0),
        )
        return req.rank in status.ranks_committed or status.state not in (
            pb.SAVE_STATE_FAILED,
            pb.SAVE_STATE_UNSPECIFIED,
        )

    def release(self, lease_id: str) -> None:
        """Give a lease back after a failed save (best effort: the daemon also reclaims it)."""
        with contextlib.suppress(Exception):
            self.connection.release_lease(pb.ReleaseLeaseRequest(lease_id=lease_id), 10.0)

    def _map(self, lease: pb.Lease) -> mmap.mmap:
        # A segment mapped for an earlier lease is mapped still: the daemon grants a
        # segment again only to the uid it was granted to, so reusing it is safe.
        name, size = lease.segment, lease.size_bytes
        with self._premap_lock:
            ahead = self._premapped.pop(name, None)
            self._premap_saves -= 1
            # Not taken by the saves they were made for (the daemon restarted, another
            # size was saved): unmapped, not held for the process's life.
            stale = list(self._premapped.values()) if self._premap_saves <= 0 else []
            self._premapped = {} if stale else self._premapped
        for old in stale:
            old.close()
        mm = self._segments.get(name)
        if mm is not None and len(mm) >= size:
            self._segments.move_to_end(name)
            if ahead is not None:
                ahead.close()
            return mm
        if ahead is not None and len(ahead) < size:  # not the segment it was made for
            ahead.close()
            ahead = None
        mm = ahead if ahead is not None else self._open(lease)
        self._segments[name] = mm
        while len(self._segments) > MAPPED_SEGMENTS:
            old = self._segments.popitem(last=False)[1]
            self._unmapping(old)
            with contextlib.suppress(BufferError):
                # A stager's tensors may still view it: then it is unmapped when the
                # last of them goes, with the mapping object.
                old.close()
        return mm

    def _open(self, lease: pb.Lease) -> mmap.mmap:
        """The lease's segment mapped, every page mapped now (MAP_POPULATE)."""
        fd = self.connection.session.open_lease(lease.lease_id)
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            return mmap.mmap(fd, lease.size_bytes, flags=flags)
        finally:
            os.close(fd)

    def premap(self, lease: pb.Lease) -> None:
        """Map a lease's segment ahead of the save that will be granted it (any thread:
        reserve.py); that save's :meth:`map` takes the mapping instead of making one."""
        if lease.segment in self._segments:
            return
        mm = self._open(lease)
        with self._premap_lock:
            dropped = [self._premapped.pop(lease.segment, None)]
            self._premapped[lease.segment] = mm
            self._premap_saves = PREMAPPED
            while len(self._premapped) > PREMAPPED:  # older ones no save took
                dropped.append(self._premapped.pop(next(iter(self._premapped))))
        for old in dropped:
            if old is not None:
                old.close()

    def _unmapping(self, mm: mmap.mmap) -> None:
        for hook in self.unmapping:
            hook(mm)

    def close(self) -> None:
        """Unmap the segments and remove the liveness file: the daemon takes back
        anything still leased."""
        for mm in self._segments.values():
            self._unmapping(mm)
            mm.close()
        self._segments.clear()
        with self._premap_lock:
            for mm in self._premapped.values():
                mm.close()
            self._premapped.clear()
        self.liveness.close()
