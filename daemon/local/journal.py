"""The handoff journal: every acknowledged save survives a daemon crash while the host lives.

``CommitShards`` is acknowledged only after a *commit* record (the lease's
segment name and the request itself) is appended to ``<root>/.journal`` and
fsynced; the segment, a named file in /dev/shm, stays granted until the step is
LOCAL or FAILED. A *done* record is appended (and fsynced) before the segment
goes back to the pool, so a commit record without a done record always names
bytes nobody has overwritten. At start-up the daemon replays those: each one
whose segment still exists is written and committed as if it had just arrived.
Shared memory does not survive a reboot of the host; neither do those saves.

Appends from concurrent commits share one fsync (group commit) on a thread of
their own, so a journal write never queues behind a large rank-file write.
The file is emptied whenever nothing in it is live, and rewritten with only
the live records at start-up.

Framing: ``<u32 length><u32 crc32c(payload)><payload>``; the payload is a JSON
header line, ``\\n``, then the body (the serialised request). A torn tail (a
crash mid-append) fails its length or checksum and is dropped on load.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.core import checksum
from ckptd.core.errors import InvalidArgument
from ckptd.core.timeline import Forks, check_forks, check_timeline

from .. import faults
from .files import fsync_dir

log = logging.getLogger("ckptd.journal")

JOURNAL = ".journal"
_FRAME = struct.Struct("<II")
_MAX_RECORD = 256 * 2**20
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
        if self.timeline is not None:
            out["timeline"], out["forks"] = self.timeline
        if self.size is not None:
            out["size"] = self.size
        return out


def _frame(header: dict[str, Any], body: bytes = b"") -> bytes:
    payload = json.dumps(header, separators=(",", ":")).encode() + b"\n" + body
    return _FRAME.pack(len(payload), checksum.value(payload)) + payload


def _timeline(header: dict[str, Any]) -> tuple[int, Forks] | None:
    """A commit record's timeline and lineage; None if absent (or not ckptd's)."""
    if "timeline" not in header:
        return None
    try:
        forks = check_forks(header.get("forks"))
        return check_timeline(header["timeline"], forks), forks
    except InvalidArgument as exc:
        log.warning("journal: a record's timeline is unreadable (%s); deciding it again", exc)
        return None


def _records(data: bytes) -> tuple[list[tuple[dict[str, Any], bytes]], int]:
    """The intact records of ``data`` and the length they span (a torn tail excluded)."""
    out, at = [], 0
    while at + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, at)
        payload = data[at + _FRAME.size : at + _FRAME.size + length]
        if length > _MAX_RECORD or len(payload) != length or checksum.value(payload) != crc:
            break
        head, _, body = payload.partition(b"\n")
        try:
            header = json.loads(head)
        except ValueError:
            break
        out.append((header, body))
        at += _FRAME.size + length
    return out, at


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
        self.appends = 0
        self.fsyncs = 0

    # -- start-up (blocking) ---------------------------------------------------
    def load(self) -> list[Entry]:
        """Read the journal, keep only live commit records (rewritten atomically), open it."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        records, good = _records(data)
        if good < len(data):
            log.warning("journal %s: dropped a torn tail of %d bytes", self.path, len(data) - good)
        live: dict[str, Entry] = {}
        for header, body in records:
            lease = str(header.get("lease", ""))
            if header.get("op") == "commit":
                size = header.get("size")
                live[lease] = Entry(
                    lease,
                    str(header["segment"]),
                    str(header["job"]),
                    body,
                    _timeline(header),
                    size if isinstance(size, int) and not isinstance(size, bool) else None,
                )
            elif header.get("op") == "done":
                live.pop(lease, None)
        kept = b"".join(_frame(e.header(), e.body) for e in live.values())
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
        size: int | None = None,
    ) -> None:
        """Record an acknowledged handoff (the timeline it went on, the segment's
        size); returns once it is on disk."""
        header = Entry(lease_id, segment, job, body, timeline, size).header()
        self._live.add(lease_id)
        try:
            await self._append(_frame(header, body), frozenset())
        except BaseException:
            self._live.discard(lease_id)
            raise

    async def done(self, lease_ids: list[str]) -> None:
        """Record that these leases' steps are LOCAL or FAILED; returns once on disk,
        after which their segments may be written again."""
        ids = [lid for lid in lease_ids if lid in self._live]
        if not ids:
            return
        records = b"".join(_frame({"op": "done", "lease": lid}) for lid in ids)
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
        os.fdatasync(self._fd)
        if commits:
            faults.hit("journal.synced")  # on disk, not yet acknowledged
        self._size += len(data)
        self.appends += 1
        self.fsyncs += 1
