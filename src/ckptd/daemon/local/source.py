"""The local tier as a restore's tier: the committed copies on this node's disk.

Two ways to hand over a rank's data, both verified against the crc32c recorded
at commit before the client sees a byte:

- into shared memory (preferred): the rank file's data section is read with
  aligned ``O_DIRECT`` reads into one of the daemon's free, already faulted
  staging segments, every shard's crc32c is checked, and the segment is lent to
  the client, whose arrays are views over it. No page cache is allocated, which
  is what makes cold restores fast on these VMs (docs/architecture.md,
  "Performance notes"). Once the client has mapped it, the segment is the
  trainer's memory: the daemon unlinks it and drops it from its pool and
  staging budget, so restored arrays the trainer keeps (an optimizer's state)
  never hold a lease.
- the file: when no free segment fits, the client maps the file copy-on-write
  and checks the crc32c itself, reporting a mismatch with ReportCorrupt.

A copy that fails its check is moved to ``<root>/.corrupt`` (removed at the next
start): the chooser then takes the bucket's copy, or the next newest step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import Future
from functools import partial
from pathlib import Path

from ckptd.core import checksum
from ckptd.core.errors import DataLoss, FailedPrecondition, NotFound
from ckptd.core.format import round_up
from ckptd.core.manifest import RankRecord
from ckptd.core.shard_table import ShardTable
from ckptd.core.verify import verify_step
from ckptd.proto import ckptd_pb2 as pb

from .. import faults
from ..catalog import Step
from ..catalog.roles import Copies
from ..files import data_offset, read_data_direct, read_header
from ..io import CRC, IoPool
from .assemble import read_increment
from .lease import Handed, Lease, Want
from .roles import Leases
from .store import LocalStore

log = logging.getLogger("ckptd.restore")

EVICTION_WAIT_SECONDS = 5.0
"""How long a restore that lost its chosen copy to the evictor waits for the catalog
to say so (the eviction is already under way: normally milliseconds)."""


class LocalSource:
    """Serves committed local copies, verified, in shared memory or as files."""

    name = "local"

    def __init__(self, catalog: Copies, store: LocalStore, staging: Leases, io: IoPool) -> None:
        self.catalog = catalog
        self.store = store
        self.staging = staging
        self.io = io

    async def holds(self, job: str, step: int | None) -> list[tuple[bool, int, int]]:
        """The steps of ``job`` committed here (verified at their commit), newest first."""
        return [s.order for s in self.catalog.list(job) if s.local and step in (None, s.step)]

    async def bring(self, job: str, step: int, want: Want) -> Handed | None:
        """The wanted rank's data section read into a free segment and verified (None:
        the client maps the file: no shared memory asked for, or no segment free)."""
        st = self.catalog.get(job, step)
        if st is None or st.manifest is None:
            raise NotFound(f"the local tier holds no copy of {job}/{step}")
        record = next((r for r in st.manifest.ranks if r.rank == want.rank), None)
        if record is None and want.rank is not None:
            raise NotFound(
                f"step {step} of job {job!r} holds no shards of rank {want.rank} on this node"
            )
        if record is None or not want.shared_memory:
            return None
        if record.incremental:
            return await self._assemble(st, record, want)
        path = self.store.step_dir(job, step) / record.file
        changed = st.changed
        try:
            offset = await self.io.run(_data_offset, path)
            lease = self.staging.take_free(job, round_up(record.size - offset), want.uid)
        except (OSError, ValueError) as exc:
            await self._evicted(st, exc, changed)
            await self._set_aside(st, [f"{record.file}: {exc}"])
            raise _lost(st, f"{record.file}: {exc}") from None
        if lease is None:
            return None
        try:
            bad = await self.io.run(
                _read_and_verify, path, offset, record, lease, st.manifest.shards
            )
        except BaseException as exc:
            self.staging.release(lease.lease_id)
            await self._evicted(st, exc, changed)
            raise
        if not bad:
            return Handed(lease, offset)
        self.staging.release(lease.lease_id)
        await self._set_aside(st, bad)
        raise _lost(st, bad[0])

    async def _assemble(self, st: Step, record: RankRecord, want: Want) -> Handed | None:
        """An incremental rank's image assembled into a free segment
        (assemble.py); None: the client maps the files, as for a full step.
        A new segment is not made for it: its pages would be allocated as the reads
        land, which is slower on these VMs than mapping the files' page cache."""
        assert st.manifest is not None and record.image_size is not None
        holders = self._holders(st, record)
        size = round_up(record.image_size)
        lease = self.staging.take_free(st.job, size, want.uid)
        if lease is None:
            return None
        path = self.store.step_dir(st.job, st.step) / record.file
        changed = st.changed
        view = lease.segment.view(0, size)
        try:
            head, bad = await self.io.run(
                read_increment, path, record, holders, view, st.manifest.shards
            )
        except BaseException as exc:
            self.staging.release(lease.lease_id)
            await self._evicted(st, exc, changed)
            if isinstance(exc, (OSError, ValueError)):
                await self._set_aside(st, [f"{record.file}: {exc}"])
                raise _lost(st, f"{record.file}: {exc}") from None
            raise
        if not bad:
            return Handed(lease, head)
        self.staging.release(lease.lease_id)
        await self._set_aside(st, bad)
        raise _lost(st, bad[0])

    def _holders(self, st: Step, record: RankRecord) -> dict[int, Path]:
        """The rank files an incremental rank's references read, each of a step this
        tier holds (the evictor keeps them while this step is kept)."""
        assert st.manifest is not None
        # A holder a later timeline replaced is read from its held copy (local/held.py).
        dirs = self.store.holder_dirs(st.manifest, partial(self.catalog.local_timeline, st.job))
        paths: dict[int, Path] = {}
        for step in sorted(record.holders()):
            where = dirs.get(step)
            if where is None:
                raise _lost(st, f"{record.file}: step {step}, which it references, is not here")
            paths[step] = where / record.file
        return paths

    async def _evicted(self, st: Step, exc: BaseException, changed: asyncio.Event) -> None:
        """NotFound if ``exc`` is the evictor removing the copy this restore chose just
        before it was marked served (its files renamed away: not corruption), once
        the catalog says so (``changed``: its event when chosen), so the next choice
        is another copy; an eviction that failed wakes us by the timeout."""
        if not (isinstance(exc, FileNotFoundError) and (st.evicting or not st.local)):
            return
        log.info("%s/%d was evicted while a restore chose it; choosing again", st.job, st.step)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), EVICTION_WAIT_SECONDS)
        raise NotFound(f"the local copy of {st.job}/{st.step} was evicted") from None

    async def report_corrupt(self, job: str, step: int, detail: str) -> None:
        """Re-verify a copy a client found corrupt; if bad, set it aside."""
        st = self.catalog.require(job, step)
        if st.manifest is None:
            raise FailedPrecondition(f"step {step} of job {job!r} has no local copy")
        holders = self.store.holder_dir(st.manifest, partial(self.catalog.local_timeline, job))
        bad = await self.io.run(
            partial(verify_step, holder_dir=holders), self.store.step_dir(job, step), st.manifest
        )
        if not bad:
            raise FailedPrecondition(
                f"step {step} of job {job!r} re-read with matching checksums; the client's "
                f"mismatch ({detail[:200]}) was not reproduced"
            )
        await self._set_aside(st, bad)

    async def _set_aside(self, st: Step, bad: list[str]) -> None:
        log.error(
            "local copy of %s/%d is corrupt (%s); setting it aside in .corrupt",
            st.job,
            st.step,
            "; ".join(bad[:5]),
        )
        await self.io.run(self.store.set_aside, st.job, st.step)
        # With a remote copy the bucket's is fetched and served instead.
        self.catalog.local_removed(st, pb.STEP_EVENT_SET_ASIDE, "; ".join(bad[:5]))


def _lost(st: Step, bad: str) -> DataLoss:
    """The answer to a restore that asked for this step, whose local copy was set aside."""
    if st.in_remote:
        return DataLoss(
            f"the local copy of step {st.step} of job {st.job!r} failed its checksum "
            f"({bad}) and was set aside; the bucket's copy is next"
        )
    return DataLoss(
        f"the local copy of step {st.step} of job {st.job!r} failed its checksum "
        f"({bad}) and was set aside; no other copy exists on this node. "
        "restore() without a step picks the newest intact one"
    )


def _data_offset(path: Path) -> int:
    faults.hit("restore.open")  # chosen and marked served, the file not yet opened
    return data_offset(path)


def _read_and_verify(
    path: Path, offset: int, record: RankRecord, lease: Lease, table: ShardTable
) -> list[str]:
    """Read a rank file's data section into ``lease`` and check it against the crc32c
    recorded at commit; returns what does not match (empty if intact).

    The whole file's crc is checked (header + data): each chunk's crc runs on
    another thread while the next chunk is read, and the pieces are combined, so
    verifying costs no per-shard work and little time beyond the read. Only a
    mismatch is narrowed down to the shards that differ.
    """
    faults.hit("restore.read")
    length = record.size - offset
    if not 8 <= offset <= min(record.size, MAX_HEADER_BYTES):
        return [f"{record.file}: a header of {offset} bytes does not fit the file"]
    view = lease.segment.view(0, round_up(length))
    pieces: list[tuple[Future[int], int]] = []

    def crc_of(pos: int, n: int) -> None:
        pieces.append((CRC.submit(checksum.value, view[pos : pos + n]), n))

    try:
        header = read_header(path, offset)
        read_data_direct(path, offset, length, view, VERIFY_CHUNK, crc_of)
    except ValueError as exc:  # short: corrupt (an OSError is the disk's, and is raised)
        return [f"{record.file}: {exc}"]
    finally:
        crcs = [(future.result(), n) for future, n in pieces]  # the view stays read
    whole = checksum.combine(checksum.value(header), checksum.combine_all(crcs), length)
    if whole == record.crc32c:
        return []
    shards = table.of_rank(record.rank)
    ranges = list(zip((shards.offset - offset).tolist(), shards.length.tolist(), strict=True))
    got = checksum.of_ranges(view, ranges)
    want = shards.crc32c.tolist()
    bad = [f"{record.file}:{k}" for k, c, w in zip(shards.keys, got, want, strict=True) if c != w]
    return bad or [f"{record.file}: its header or padding differs from the commit"]


VERIFY_CHUNK = 8 * 2**20
"""Bytes read per call when restoring: the crc of one runs while the next is read."""
MAX_HEADER_BYTES = 100 * 2**20
"""Largest safetensors header (the format's own limit)."""
