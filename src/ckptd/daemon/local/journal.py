"""The handoff journal: every acknowledged save survives a daemon crash while the host lives.

``CommitShards`` is acknowledged only after a *commit* record (the lease's
segment name and the request itself) is appended to ``<root>/.journal``; the
segment, a named file in /dev/shm, stays granted until the step is LOCAL or
ended. A *done* record is appended before the segment goes back to the pool, so
a commit record without a done record always names bytes nobody has
overwritten. At start-up the daemon replays those: each one whose segment still
exists is written and committed as if it had just arrived.

Appends are written, not fsynced: a record is needed only while the segment it
names exists, and shared memory lives exactly as long as the kernel whose page
cache holds the record (a killed daemon's successor reads it there); a reboot
takes the segments and those saves with them, and a record torn by it is dropped
on load. An fsync would buy nothing, and on a disk busy with a rank-file write
it held the trainer's acknowledgement (and a superseded save's memory) behind
that write.

Appends from concurrent commits share one write (group commit) on a thread of
their own, so a journal write never queues behind a large rank-file write.
The file is emptied whenever nothing in it is live, and rewritten with only
the live records at start-up.

Records are framed with a marker, a length and a crc32c (journal_format.py). A
torn tail (a crash mid-append, never acknowledged) is dropped on load; a record
damaged in the middle of the file, or one that fails the record schema, is
refused and named in the log (its job and step where they can still be read),
and the records after it are read on.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckptd.core.errors import InvalidArgument
from ckptd.core.timeline import Forks, check_forks, check_timeline

from .. import faults
from ..files import fsync_dir
from .journal_format import Lost, Scan, check, frame, scan

log = logging.getLogger("ckptd.journal")

JOURNAL = ".journal"
_COMPACT_BYTES = 4 * 2**20
"""Empty the file once nothing in it is live and it has grown past this."""


@dataclass(frozen=True)
class Entry:
    """A live commit record: a handoff acknowledged but not yet LOCAL or FAILED."""

    lease_id: str
    segment: str
    job: str
    body: bytes
    timeline: tuple[int, Forks] | None = None
    """The timeline the daemon put the save on when it acknowledged it, with the
    lineage (core/timeline.py); None in a record of a ckptd that had none."""
    step: int | None = None
    """The step saved, so that a damaged record can still be named; None in a
    record of a ckptd that did not write it."""
    size: int | None = None
    """The segment's size in bytes: replay maps only a file of exactly this size
    (None in a record of a ckptd that did not write it)."""

    def header(self) -> dict[str, Any]:
        """The record's header as :meth:`Journal.commit` writes it."""
        out: dict[str, Any] = {
            "op": "commit",
            "lease": self.lease_id,
            "segment": self.segment,
            "job": self.job,
        }
        if self.step is not None:  # after "job": journal_format reads them in this order
            out["step"] = self.step
        if self.timeline is not None:
            out["timeline"], out["forks"] = self.timeline
        if self.size is not None:
            out["size"] = self.size
        return out


def _timeline(header: dict[str, Any]) -> tuple[int, Forks] | None:
    """A commit record's timeline and lineage; None if absent (or not ckptd's)."""
    if "timeline" not in header:
        return None
    try:
        forks = check_forks(header.get("forks"))
        return check_timeline(header["timeline"], forks), forks
    except (InvalidArgument, TypeError, ValueError) as exc:
        log.warning("journal: a record's timeline is unreadable (%s); deciding it again", exc)
        return None


def _check_body(entry: Entry, parse: Callable[[bytes], Any]) -> Entry | Lost:
    """``entry`` (with its step, read from the request in a record that lacks it) if
    its body is the valid request its header says; else why it is refused."""
    try:
        req = parse(entry.body)
    except Exception as exc:  # crafted or damaged bytes: whatever the parser raises
        why = f"holds no valid request ({str(exc)[:200] or type(exc).__name__})"
    else:
        step = req.step if entry.step is None else entry.step
        if (req.lease_id, req.job, req.step) == (entry.lease_id, entry.job, step):
            return replace(entry, step=step)
        why = f"holds the request of lease {req.lease_id!r}, job {req.job!r}, step {req.step}"
    return Lost(0, len(entry.body), why, "commit", entry.lease_id, entry.job, entry.step)


class Journal:
    """The append-only journal of one root. :meth:`load` once, then :meth:`commit` /
    :meth:`done` from the event loop."""

    def __init__(self, root: Path) -> None:
        self.path = root / JOURNAL
        self._fd = -1
        self._thread = ThreadPoolExecutor(1, "ckptd-journal")
        self._queue: list[tuple[bytes, frozenset[str], asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._live: set[str] = set()
        self._size = 0
        self.lost: list[Lost] = []
        """What :meth:`load` refused: damaged records and records that fail the schema."""

    # -- start-up (blocking) ---------------------------------------------------
    def load(self, parse: Callable[[bytes], Any] | None = None) -> list[Entry]:
        """Read the journal, keep only live commit records (rewritten atomically), open it.

        ``parse``: checks a commit record's body, raising on one that is not a valid
        request; it returns the request, whose ``lease_id``, ``job`` and ``step`` must
        be the record's. A record refused is named in the log and in :attr:`lost`."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        live = self._replay(scan(data), parse)
        kept = b"".join(frame(e.header(), e.body) for e in live.values())
        tmp = self.path.with_name(JOURNAL + ".tmp")
        with open(tmp, "wb") as f:
            f.write(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._size = len(kept)
        self._live = set(live)
        return list(live.values())

    def _replay(self, found: Scan, parse: Callable[[bytes], Any] | None) -> dict[str, Entry]:
        """The live commit records of ``found``; every refused one logged and kept in
        :attr:`lost`."""
        if found.torn_tail:
            log.warning(
                "journal %s: dropped a torn tail of %d bytes (a crash mid-append: never "
                "acknowledged)",
                self.path,
                found.torn_tail,
            )
        self.lost = list(found.lost)
        live: dict[str, Entry] = {}
        by_segment: dict[str, str] = {}
        finished: set[str] = set()
        for at, size, header, body in found.records:
            refused = check(at, size, header, body)
            if refused is not None:
                self.lost.append(refused)
                continue
            lease = header["lease"]
            if header["op"] == "done":
                live.pop(lease, None)
                finished.add(lease)
                continue
            size = header.get("size")  # journal_format.check: a non-negative int or absent
            entry = Entry(
                lease, header["segment"], header["job"], body, None, header.get("step"), size
            )
            if parse is not None:
                # Before the segment check below: a refused record must not retire another.
                checked = _check_body(entry, parse)
                if isinstance(checked, Lost):
                    self.lost.append(replace(checked, offset=at, nbytes=size))
                    continue
                entry = checked
            # A segment is granted again only after its done record is on disk: an
            # earlier live record naming it has finished, even if that record is lost.
            earlier = by_segment.pop(header["segment"], None)
            if earlier is not None and earlier != lease:
                live.pop(earlier, None)
            by_segment[header["segment"]] = lease
            live[lease] = replace(entry, timeline=_timeline(header))
        self.lost.sort(key=lambda lost: lost.offset)
        for lost in self.lost:
            if lost.op == "commit" and lost.lease in finished:
                # Its done record is intact: that save finished, nothing of it is lost.
                log.warning(
                    "journal %s: the record of a finished save of job %r %s; nothing is lost",
                    self.path,
                    lost.job,
                    lost.why,
                )
            else:
                level = logging.WARNING if lost.harmless else logging.ERROR
                log.log(level, "journal %s: %s", self.path, lost.describe())
        return live

    def close(self) -> None:
        """Close the file and the journal's thread."""
        self._thread.shutdown(wait=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @property
    def live(self) -> int:
        """Handoffs acknowledged and not yet LOCAL or FAILED."""
        return len(self._live)

    # -- appends ------------------------------------------------------------------
    async def commit(
        self,
        lease_id: str,
        segment: str,
        job: str,
        body: bytes,
        timeline: tuple[int, Forks] | None = None,
        step: int | None = None,
        size: int | None = None,
    ) -> None:
        """Record an acknowledged handoff (the timeline it went on, its step, the
        segment's size); returns once it is written."""
        header = Entry(lease_id, segment, job, body, timeline, step, size).header()
        self._live.add(lease_id)
        try:
            await self._append(frame(header, body), frozenset())
        except BaseException:
            self._live.discard(lease_id)
            raise

    async def done(self, lease_ids: list[str]) -> None:
        """Record that these leases' steps are LOCAL or FAILED; returns once written,
        after which their segments may be written again."""
        ids = [lid for lid in lease_ids if lid in self._live]
        if not ids:
            return
        records = b"".join(frame({"op": "done", "lease": lid}) for lid in ids)
        await self._append(records, frozenset(ids))
        self._live.difference_update(ids)

    async def _append(self, record: bytes, resolves: frozenset[str]) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((record, resolves, fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
        # Shielded: a cancelled caller must not leave a batch half-reported.
        await asyncio.shield(fut)

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            batch, self._queue = self._queue, []
            data = b"".join(record for record, _, _ in batch)
            resolved = frozenset().union(*(r for _, r, _ in batch))
            # Once this batch is on disk nothing earlier in the file is live.
            compact = not (self._live - resolved) and self._size > _COMPACT_BYTES
            try:
                commits = any(not r for _, r, _ in batch)
                await loop.run_in_executor(self._thread, self._write, data, compact, commits)
            except Exception as exc:
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_result(None)

    def _write(self, data: bytes, compact: bool, commits: bool) -> None:
        if self._fd < 0:
            raise RuntimeError("the journal is closed")
        faults.hit("journal.write" if commits else "journal.done")
        if compact:
            # Nothing live: the records on file describe finished steps only.
            os.ftruncate(self._fd, 0)
            self._size = 0
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        # No fsync: see the module's docstring (the record lives as long as its segment).
        if commits:
            faults.hit("journal.synced")  # written, not yet acknowledged
        self._size += len(data)
