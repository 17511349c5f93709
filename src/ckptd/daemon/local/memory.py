"""The memory tier: the newest committed steps stay in shared memory after LOCAL.

A save's lease holds the exact image of its rank file's data section when the
step commits. Instead of going back to the pool, the segment is kept, with what
it holds (job, step, rank, timeline, the header's crc32c and length, the file's
crc32c), and a restore of that rank is answered from it: the client maps the
segment copy-on-write from a read-only descriptor (no copy, no disk read), after
the daemon checked the bytes against the crc32c recorded at commit. A trainer
killed on a live node restarts from memory, not from disk.

Rules (docs/architecture.md, "The memory tier"):

- **Saves first.** Kept segments are part of the staging budget, and a lease that
  finds no free segment and no budget takes them first (:meth:`MemoryTier.give_way`,
  called by staging), as does one the shm filesystem cannot hold (:meth:`shed`): a
  save never waits or fails because the tier holds memory.
  Within its own limits the tier keeps ``memory_tier_steps`` newest steps per job
  and at most ``memory_tier_bytes`` in all; older steps go first.
- **Lent only once no other process can write it.** The process that wrote a
  segment still maps it writable. While it may live (or is unknown: a handoff
  replayed after a daemon crash), the segment is lent to no other process and
  their restores are served from the disk: a restorer's copy-on-write pages it
  has not written follow the segment, so the writer's later writes would change
  its arrays. The writer itself may restore it (what it writes then is its own
  doing), checked at every restore. Once the writer is gone (its session closed
  and it exited: sessions.py; or found exited at a restore), the segment is
  checked once and, if intact, served unchecked from then on: no process can
  write into it any more (the daemon never writes a kept segment, and restored
  trainers map it private). A copy that fails its check is let go; the restore
  is served from the disk like any corrupt copy.
- **Restored memory is the trainer's.** A segment a restore mapped is never granted
  for a save again; when the tier lets it go, it returns to the pool only if no
  process maps it any more, else it leaves the pool and the budget (staging.py).
- **Survives the trainer and a daemon crash, never a reboot.** Each kept segment
  has a small record beside it (``<segment>.kept``); a daemon that restarts after a
  crash takes back every segment whose record matches a LOCAL step of the catalog
  (checked before it is mapped, as the journal's segments are) and checks it at
  its first restore. A clean stop gives the memory back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable, Coroutine
from dataclasses import asdict
from typing import Any

from ckptd.core import checksum
from ckptd.core.errors import NotFound

from ..catalog import Event, Step
from ..catalog.roles import Copies
from .kept import Image, Kept, live_writer
from .lease import Handed, Lease, Segment, Want
from .liveness import process_running, process_start
from .roles import Keeping
from .room import Room
from .staging import KEPT_SUFFIX

log = logging.getLogger("ckptd.memory")

CHECK_CHUNK = 64 * 2**20
"""Bytes checksummed per call (the event loop is never blocked: a thread runs it)."""

Spawn = Callable[[str, Coroutine[Any, Any, None]], None]


class MemoryTier:
    """Committed rank files kept in shared memory; a restore's fastest tier."""

    name = "memory"

    def __init__(
        self,
        staging: Keeping,
        catalog: Copies,
        steps: int,
        budget_bytes: int,
        spawn: Spawn,
        room: Room,
    ) -> None:
        """``room``: the one staging asks for room (the same one it was built with);
        this tier serves it."""
        self.staging = staging
        self.catalog = catalog
        self.steps = steps
        """Newest steps kept per job (0: the tier is off)."""
        self.budget_bytes = budget_bytes or staging.budget_bytes
        """Most bytes kept on this node (within the staging budget)."""
        self._spawn = spawn
        self._kept: dict[tuple[str, int, int], Kept] = {}
        self.restores = 0
        """Restores answered from memory."""
        self.evicted = 0
        """Copies let go: for a save's memory, a newer step, the byte cap, a failed check."""
        room.serve(self)
        catalog.subscribe(self._on_event)

    # -- what it holds ------------------------------------------------------
    @property
    def kept_bytes(self) -> int:
        """Shared memory holding kept rank files."""
        return sum(k.segment.size for k in self._kept.values())

    @property
    def files(self) -> int:
        """Rank files kept."""
        return len(self._kept)

    def status(self) -> dict[str, Any]:
        """The memory tier's part of ``GetStatus``."""
        return {
            "memory_tier_bytes": self.kept_bytes,
            "memory_tier_files": self.files,
            "memory_tier_budget_bytes": self.budget_bytes if self.steps else 0,
            "memory_tier_steps": self.steps,
            "memory_tier_restores": self.restores,
            "memory_tier_evicted": self.evicted,
        }

    # -- keeping --------------------------------------------------------------
    def keep(
        self, st: Step, rank: int, lease: Lease, layout: tuple[int, int, int], file_crc: int
    ) -> bool:
        """Keep ``rank``'s committed file of ``st``, whose data section is ``lease``
        (``layout``: header length, header crc32c, data length), instead of giving
        the segment back; False: not kept (the tier is off, or the file is larger
        than its cap)."""
        image = Image(st.job, st.step, rank, st.timeline, *layout, file_crc)
        seg = lease.segment
        if not self.steps or seg.size > self.budget_bytes or not seg.populated:
            return False
        key = (image.job, image.step, image.rank)
        old = self._kept.pop(key, None)
        if old is not None:
            self._drop(old, "replaced")
        try:
            self._write_record(seg, image, lease.owner)
        except OSError as exc:  # /dev/shm full: the step is LOCAL all the same
            log.warning("memory tier: not keeping %s/%d rank %d: %s", *key, exc)
            return False
        if not self.staging.keep(lease, key):
            return False  # the pool stopped meanwhile: its segments are gone
        started = process_start(lease.owner[1]) if lease.owner is not None else None
        k = self._kept[key] = Kept(image, seg, lease.owner, lease.owner is not None, started)
        if lease.owner is not None and started is None:
            # Killed between its save's acknowledgement and LOCAL (the common crash):
            # nothing will say it exited; checked once now, before its restart asks.
            k.writer = None
            self._spawn(f"check memory tier {key}", self._check_quietly(k))
        self._mark(st)
        self._trim(image.job)
        return key in self._kept

    def grows_with(self, job: str, size: int) -> bool:
        """Whether keeping a save of ``job`` of ``size`` bytes adds a segment to the
        tier (it keeps fewer than ``steps`` of the job's steps): staging.py begins a
        spare for the job's next save at once."""
        if not self.steps or size > self.budget_bytes:
            return False
        return len({(k.image.timeline, k.image.step) for k in self._of(job)}) < self.steps

    def _trim(self, job: str) -> None:
        """Older steps of ``job`` beyond ``steps``, then the least recent anywhere
        while over the byte cap."""
        newest = sorted({(k.image.timeline, k.image.step) for k in self._of(job)}, reverse=True)
        for k in self._of(job):
            if (k.image.timeline, k.image.step) not in newest[: self.steps]:
                self._evict(k, "a newer step is kept")
        for k in sorted(self._kept.values(), key=self._value):
            if self.kept_bytes <= self.budget_bytes:
                break
            self._evict(k, "memory_tier_bytes")

    async def give_way(self, need: int, uid: int | None) -> None:
        """Let kept segments go until a lease of ``need`` bytes for ``uid`` fits: first
        a segment it can reuse as it is (no fresh memory), the least valuable first;
        else the least valuable, until the budget has room."""
        while self._kept and not self._room(need, uid):
            victims = sorted(self._kept.values(), key=self._value)
            fits = [k for k in victims if k.segment.size >= need and k.segment.uid in (None, uid)]
            await self._let_go((fits or victims)[0], "a save needed the memory")

    async def shed(self, need: int) -> bool:
        """The shm filesystem is full: let kept segments go, the least valuable first,
        until at least ``need`` bytes are free to reuse or remove; False if none."""
        released = 0
        while self._kept and released < need:
            victim = min(self._kept.values(), key=self._value)
            if await self._let_go(victim, "the shared-memory filesystem is full"):
                released += victim.segment.size
        return released > 0

    async def _let_go(self, k: Kept, why: str) -> bool:
        """Let ``k`` go once no check reads it (bounded, short); False if it went
        meanwhile."""
        if k.checking is not None:
            await asyncio.shield(k.checking)
        if self._kept.get(_key(k)) is not k:
            return False
        self._evict(k, why)
        return True

    def _room(self, need: int, uid: int | None) -> bool:
        """Whether staging can grant ``need`` bytes to ``uid`` now: a free segment it
        may reuse, or budget once it drops the free ones it may not (staging.py)."""
        staging = self.staging
        free = staging.free_segments()
        if any(s.size >= need and s.uid in (None, uid) for s in free):
            return True
        dropped = sum(s.size for s in free)
        return staging.allocated_bytes - dropped + need <= staging.budget_bytes

    def _value(self, k: Kept) -> tuple[bool, float]:
        """Sort key, least valuable first: steps older than their job's newest kept
        one, then the least recently kept."""
        newest = max((o.image.timeline, o.image.step) for o in self._of(k.image.job))
        return (k.image.timeline, k.image.step) == newest, k.kept_at

    def _of(self, job: str) -> list[Kept]:
        return [k for k in self._kept.values() if k.image.job == job]

    # -- restore ------------------------------------------------------------------
    async def holds(self, job: str, step: int | None) -> list[tuple[bool, int, int]]:
        """No step of its own: every step kept here is one the catalog knows."""
        return []

    async def bring(self, job: str, step: int, want: Want) -> Handed | None:
        """The wanted rank's kept file, checked, as a shared restore lease."""
        k = self._kept.get((job, step, -1 if want.rank is None else want.rank))
        if k is None or not (want.shared_memory and want.copy_on_write):
            raise NotFound(f"the memory tier holds no copy of {job}/{step} rank {want.rank}")
        st = self.catalog.get(job, step)
        if st is None or st.timeline != k.image.timeline:
            self._evict(k, "its step is gone")
            raise NotFound(f"the memory tier's copy of {job}/{step} is of an older timeline")
        if want.uid is not None and k.segment.uid not in (None, want.uid):
            raise NotFound(f"the memory tier's copy of {job}/{step} is another user's")
        if self._writer_may_write(k) and (k.writer is None or k.writer != want.process):
            raise NotFound(
                f"the memory tier's copy of {job}/{step} rank {want.rank} is not lent while "
                "the process that wrote it may still write it; next tier"
            )
        if not await self._check(k):
            raise NotFound(
                f"the memory tier's copy of {job}/{step} rank {want.rank} failed its "
                "checksum and was let go; served from the next tier"
            )
        if self._kept.get(_key(k)) is not k or k.segment.lease_id is not None:
            raise NotFound(f"the memory tier's copy of {job}/{step} is in use; next tier")
        self.restores += 1
        return Handed(self.staging.grant_kept(job, k.segment), k.image.header_len)

    async def _check(self, k: Kept) -> bool:
        """Whether ``k``'s bytes match the crc32c recorded at commit: once for good
        after its writer is gone, else now. A mismatch lets it go."""
        if k.quiet:
            return True
        if k.checking is None:
            k.checking = asyncio.get_running_loop().create_future()
            quiet = k.writer is None and k.known_writer
            try:
                ok = await asyncio.to_thread(_intact, k)
            except BaseException as exc:
                k.checking.set_exception(exc)
                k.checking.exception()  # retrieved: only awaited by others
                k.checking = None
                raise
            done, k.checking = k.checking, None
            k.quiet = ok and quiet
            if not ok and self._kept.get(_key(k)) is k:
                log.error(
                    "the memory tier's copy of %s/%d rank %d does not match its crc32c; "
                    "letting it go",
                    k.image.job,
                    k.image.step,
                    k.image.rank,
                )
                self._evict(k, "failed its check")
            done.set_result(ok)
            return ok
        return await asyncio.shield(k.checking)

    def _writer_may_write(self, k: Kept) -> bool:
        """Whether a process may still write ``k``'s segment: its writer lives, or
        who wrote it is unknown. A writer found exited is taken as gone."""
        if k.writer is None:
            return not k.known_writer
        if k.started is not None and not process_running(k.writer[1], k.started):
            k.writer, k.quiet = None, False  # exited before its session's end was seen
            return False
        return True

    def writer_gone(self, process: tuple[int, int]) -> None:
        """A process exited: the segments it wrote can change no more; check each
        once now, so the restart that follows is answered without waiting."""
        for k in list(self._kept.values()):
            if k.writer == process:
                k.writer = None
                k.quiet = False
                self._spawn(f"check memory tier {_key(k)}", self._check_quietly(k))

    async def _check_quietly(self, k: Kept) -> None:
        with contextlib.suppress(Exception):
            await self._check(k)

    # -- letting go --------------------------------------------------------------
    def _evict(self, k: Kept, why: str) -> None:
        if self._kept.get(_key(k)) is not k:
            return
        del self._kept[_key(k)]
        self.evicted += 1
        log.info("memory tier: let go of %s/%d rank %d (%s)", *_key(k), why)
        self._drop(k, why)

    def _drop(self, k: Kept, why: str) -> None:
        with contextlib.suppress(OSError):
            self.staging.path_of(k.segment).with_name(k.segment.name + KEPT_SUFFIX).unlink()
        if k.checking is not None:  # a thread reads it: given back once it is done
            k.checking.add_done_callback(lambda _: self.staging.let_go(k.segment))
        else:
            self.staging.let_go(k.segment)
        st = self.catalog.get(k.image.job, k.image.step)
        if st is not None:
            self._mark(st)

    def _mark(self, st: Step) -> None:
        ranks = frozenset(r for (j, s, r) in self._kept if (j, s) == (st.job, st.step))
        self.catalog.in_memory(st, ranks)

    def _on_event(self, event: Event) -> None:
        """A step gone from the catalog, saved again on a new timeline, found unusable,
        or without its local copy (evicted or set aside: a copy here is served with the
        local copy's manifest, and the bucket's copy is fetched whole): its copies go."""
        key = (event.job, event.step)
        for k in [k for k in self._kept.values() if (k.image.job, k.image.step) == key]:
            st = self.catalog.get(k.image.job, k.image.step)
            if st is None or st.timeline != k.image.timeline or st.unusable or not st.local:
                self._evict(k, "its step is gone")

    def close(self) -> None:
        """A clean stop: the memory goes back (staging removes the segments)."""
        for k in list(self._kept.values()):
            with contextlib.suppress(OSError):
                self.staging.path_of(k.segment).with_name(k.segment.name + KEPT_SUFFIX).unlink()
        self._kept.clear()

    # -- records --------------------------------------------------------------------
    def _write_record(self, seg: Segment, image: Image, writer: tuple[int, int] | None) -> None:
        # The writer's start time with its pid: a later process under a reused pid
        # is never taken for it (liveness.py).
        started = process_start(writer[1]) if writer is not None else None
        who = [*writer, started] if writer is not None and started is not None else None
        path = self.staging.path_of(seg).with_name(seg.name + KEPT_SUFFIX)
        text = json.dumps({**asdict(image), "size": seg.size, "writer": who}).encode()
        # 0600 like the segment it names; never through a link.
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            os.write(fd, text)
        finally:
            os.close(fd)

    def adopt_leftovers(self) -> int:
        """At start-up, before the staging leftovers are removed: take back the kept
        segments of a daemon that crashed, each whose record matches a LOCAL step, within
        this daemon's limits; how many rank files it keeps."""
        if not self.steps or not self.staging.dir.is_dir():
            return 0
        found = []
        for record in sorted(self.staging.dir.glob("*" + KEPT_SUFFIX)):
            name = record.name.removesuffix(KEPT_SUFFIX)
            try:
                fields = json.loads(record.read_text())
                size, who = int(fields.pop("size")), fields.pop("writer", None)
                found.append((Image(**fields), name, size, who))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("memory tier: not taking back segment %s: %s", name, exc)
        # Newest first: what the staging budget cannot hold goes, the oldest first.
        for image, name, size, who in sorted(found, key=lambda f: (f[0].timeline, f[0].step))[::-1]:
            try:
                self._adopt(name, image, size, who)
            except (OSError, ValueError) as exc:
                log.warning("memory tier: not taking back segment %s: %s", name, exc)
        # The last daemon may have kept more (its limits were larger): these are ours.
        for job in sorted({k.image.job for k in self._kept.values()}):
            self._trim(job)
        return self.files

    def _adopt(self, name: str, image: Image, size: int, who: Any) -> bool:
        st = self.catalog.get(image.job, image.step)
        if st is None or st.manifest is None or st.timeline != image.timeline:
            return False
        rec = next((r for r in st.manifest.ranks if r.rank == image.rank), None)
        if rec is None or rec.image_crc != image.file_crc:
            return False
        if rec.image_bytes != image.header_len + image.data_len:
            return False
        key = (image.job, image.step, image.rank)
        if size < image.data_len:
            return False
        if self.staging.allocated_bytes + size > self.staging.budget_bytes:
            return False  # beyond this daemon's staging budget: removed as a leftover
        seg = self.staging.adopt_kept(name, size, self.staging.uid_of(image.job), key)  # lent
        # A writer that lives on is followed again (its next session's end says when
        # it exits); one already gone leaves nothing to wait for: checked once now.
        # A record naming none: every restore checks it.
        writer = live_writer(who)
        started = int(who[2]) if writer is not None else None
        k = self._kept[key] = Kept(image, seg, writer, who is not None, started)
        self._mark(st)
        if k.known_writer and writer is None:
            self._spawn(f"check memory tier {key}", self._check_quietly(k))
        return True


def _key(k: Kept) -> tuple[str, int, int]:
    return k.image.job, k.image.step, k.image.rank


def _intact(k: Kept) -> bool:
    """crc32c of the header (recorded) and the kept data section, combined, against
    the rank file's crc32c recorded at commit."""
    im = k.image
    view = k.segment.view(0, im.data_len)
    crc = 0
    for pos in range(0, im.data_len, CHECK_CHUNK):
        crc = checksum.extend(crc, view[pos : pos + CHECK_CHUNK])
    return checksum.combine(im.header_crc, crc, im.data_len) == im.file_crc
