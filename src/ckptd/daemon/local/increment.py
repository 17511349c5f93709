"""The save path's incremental write: shards the job's previous step already holds
are referenced (core/increments.py), only the rest is written.

One pass over the lease first (crc32c of every shard and of the whole image, and,
for a save without the trainer's word, the SHA-256 on two threads of each shard
whose crc32c is its base's, or of every shard with no base), then the decision,
then the runs written with aligned ``O_DIRECT`` writes like a full file. What the
previous step holds is read back only for a digest it lacks of a shard that may be
unchanged (it was written whole without a scan); its manifest says where each
shard is and what its crc32c is. A save of a rank whose saves change every shard
skips the pass (:class:`Habits`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ckptd.core import checksum, increments
from ckptd.core.health import NonFiniteCount
from ckptd.core.manifest import RankRecord, rank_file_name
from ckptd.core.shard_table import ShardTable

from .. import faults
from ..catalog import Step
from ..catalog.roles import Steps
from ..files import write_runs_direct
from .records import RankLayout
from .store import LocalStore

if TYPE_CHECKING:  # the saver imports this module
    from .pending import CommitRequest, PendingStep

DIGESTS = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="ckptd-digest")
"""SHA-256 of the shards of saves without the trainer's word (hashlib lets go of the
GIL: two shards at once)."""


@dataclass(frozen=True)
class Increments:
    """The daemon's incremental settings (``incremental``, ``incremental_max_files``,
    ``incremental_full_every``; a client turns them off per job)."""

    enabled: bool = True
    max_files: int = 8
    full_every: int = 0


@dataclass(frozen=True)
class Base:
    """The step a save may reference, held (``Catalog.in_use``) until the save is LOCAL."""

    step: Step
    previous: increments.Previous
    nonfinite: dict[str, int]
    """Its NaN/Inf counts of this rank (a reused shard's are the same)."""


def base_of(catalog: Steps, st: Step, rank: int, full_every: int) -> Base | None:
    """The job's newest LOCAL step before ``st`` on its live history, if it holds this
    rank as ckptd's own rank file and the chain of references may grow; else None."""
    older = [
        s
        for s in catalog.list(st.job)
        if s.local
        and not s.evicting
        and s.manifest is not None
        and not s.manifest.adopted
        and not s.abandoned
        and s.timeline == st.timeline
        and s.step < st.step
    ]
    if not older:
        return None
    prev = max(older, key=lambda s: s.order)
    m = prev.manifest
    assert m is not None
    if full_every and m.increment + 1 >= full_every:
        return None  # this save starts a new chain
    record = next((r for r in m.ranks if r.rank == rank), None)
    if record is None:
        return None
    previous = increments.Previous(
        prev.step,
        record.runs,
        increments.refs_of(record.refs),
        m.shards.of_rank(rank),
        record.digests,
    )
    return Base(prev, previous, dict((m.nonfinite or {}).get(str(rank), {})))


def hold_base(catalog: Steps, pending: PendingStep, rank: int, opts: Increments) -> Base | None:
    """The step ``pending``'s rank may reference, held from now until the save is
    LOCAL or FAILED (``pending.holds``): the evictor keeps it, and with it whatever
    it references."""
    base = base_of(catalog, pending.step, rank, opts.full_every)
    if base is not None and base.step is not pending.base:
        pending.holds.enter_context(catalog.in_use(base.step))
        pending.base = base.step
    return base


def chain_of(pending: PendingStep) -> int:
    """A save's place in its chain of incremental saves: its base's, plus one."""
    base = pending.base.manifest if pending.base is not None else None
    return base.increment + 1 if base is not None else 0


class Habits:
    """Per job and rank, whether its last save with a base could reference nothing of
    it (every shard changed, the common case of a training step): the next such save
    skips the scan before the write and writes whole, its crc32c computed on the way
    (one pass over the lease, not two). It compares its crcs with its base's after
    the write, so once shards stop changing the save after it scans again: at most
    one save is written whole that could have referenced some of its shards."""

    def __init__(self) -> None:
        self._changing: set[tuple[str, int]] = set()

    def scans(self, req: CommitRequest, base: Base | None) -> bool:
        """Whether ``req``'s save scans before it writes (:func:`write`). A save with
        no base always does: its digests spare the next save reading them back from
        its file for every shard that did not change (a model's frozen weights)."""
        word = word_of(req, base)
        if base is None or (word is not None and word.any()):
            return True
        return (req.job, req.rank) not in self._changing

    def learn(self, req: CommitRequest, base: Base | None, alike: bool) -> None:
        """``req``'s rank is written; ``alike``: whether any of its shards' crc32c
        equals its base's at the same key (:func:`alike`). It decides whether the
        next save scans."""
        key = (req.job, req.rank)
        if base is not None and not alike:
            self._changing.add(key)
        else:
            self._changing.discard(key)


def alike(req: CommitRequest, base: Base | None, done: Written | Scan | None, crcs: Any) -> bool:
    """Whether any shard of ``req`` may equal its base's (the same key, the same
    crc32c): the scan's answer (``done``, :func:`write`'s result), else its shards'
    crc32c ``crcs`` compared (per-shard Python: on a thread for many shards)."""
    if isinstance(done, Written):
        return True  # it references some
    if done is not None:
        return done.alike
    return base is not None and bool(
        increments.candidates(req.table.keys, crcs, base.previous).any()
    )


def word_of(req: CommitRequest, base: Base | None) -> npt.NDArray[np.bool_] | None:
    """The trainer's word for which shards are unchanged since ``base``, if it gave one
    for that very step."""
    return req.unchanged if base and req.unchanged_since == base.step.step else None


@dataclass(frozen=True)
class Scan:
    """What one pass over a lease learnt: each shard's crc32c, the image's, digests."""

    crcs: list[int]
    image_crc: int
    digests: list[str] | None
    """Per shard, its SHA-256 where computed (``""`` elsewhere); None: none computed."""
    alike: bool
    """Whether any shard's crc32c is its base's at the same key (False: no base)."""


def scan(
    header: bytes,
    data: memoryview,
    data_len: int,
    layout: RankLayout,
    req: CommitRequest,
    base: Base | None,
    word: npt.NDArray[np.bool_] | None,
) -> Scan:
    """crc32c of every shard and of the image (header + data), then SHA-256 of each
    shard that may equal the base's without the trainer's word for it: its crc32c is
    the base's shard's at the same key (every shard, for a save with no base, so that
    the next save can compare). A shard whose crc differs changed: no digest."""
    flat = np.frombuffer(data, np.uint8)
    stream = checksum.FileCrc(header, layout.ranges, data_len, layout.pieces)
    stream.feed(flat, data_len)
    image_crc, crcs = stream.result()
    worded = word if word is not None else np.zeros(len(crcs), bool)
    if base is None:
        todo, same = np.flatnonzero(~worded), False
    else:
        maybe = increments.candidates(req.table.keys, crcs, base.previous)
        todo, same = np.flatnonzero(maybe & ~worded), bool(maybe.any())
    if not len(todo):
        return Scan(crcs, image_crc, None, same)
    futures = {
        i: DIGESTS.submit(increments.digest, data[o : o + n])
        for i in todo.tolist()
        for o, n in [layout.ranges[i]]
    }
    digests = [futures[i].result() if i in futures else "" for i in range(len(crcs))]
    return Scan(crcs, image_crc, digests, same)


@dataclass(frozen=True)
class Written:
    """An incremental rank file as written, and its shards as the manifest records them."""

    record: RankRecord
    shards: ShardTable
    nonfinite: dict[str, int]


def write(
    path: Path,
    header: bytes,
    data: memoryview,
    data_len: int,
    layout: RankLayout,
    req: CommitRequest,
    base: Base | None,
    max_files: int,
    holder_file: Callable[[int], Path],
) -> Written | Scan:
    """Write ``req``'s rank file referencing what ``base`` holds; returns the
    :class:`Scan` instead, writing nothing, if nothing can be referenced (the caller
    writes the whole file, recording the scan's digests). ``holder_file(step)``: that
    step's rank file of this rank in the local tier."""
    word = word_of(req, base)
    found = scan(header, data, data_len, layout, req, base, word)
    if base is None:
        return found
    head = len(header)
    table = req.table.placed(req.rank, head, found.crcs)
    previous = _with_digests(base.previous, table.keys, found.digests, holder_file)
    reused, refs, inherited = increments.reuse(table, found.crcs, previous, word, found.digests)
    if not reused.any() or len({r.step for r in refs}) + 1 > max_files:
        return found
    image_size = head + data_len
    faults.hit("write.increment")  # decided, the base held, nothing written yet
    runs = increments.round_runs(increments.own_ranges(head, table, reused), image_size)
    crc = write_runs_direct(path, header, data, runs)
    record = RankRecord(
        req.rank,
        rank_file_name(req.rank),
        sum(n for _, n in runs),
        crc,
        req.tree,
        runs=[[s, n] for s, n in runs],
        refs=[r.as_list() for r in refs],
        image_size=image_size,
        image_crc32c=found.image_crc,
        digests=_digests(found.digests, inherited),
    )
    return Written(record, table, _nonfinite(req, data, layout, reused, base))


def _with_digests(
    prev: increments.Previous,
    keys: list[str],
    digests: list[str] | None,
    holder_file: Callable[[int], Path],
) -> increments.Previous:
    """``prev`` with a digest of each of its shards this save has a digest to compare
    with and it has none: a shard that changed at the base's save and not since
    (the base hashed only what it could reuse). Read from the file holding it."""
    if digests is None:
        return prev
    have = list(prev.digests or [""] * len(prev.table))
    where = {k: j for j, k in enumerate(prev.table.keys)}
    missing = [where[k] for k, d in zip(keys, digests, strict=True) if d and not have[where[k]]]
    if not missing:
        return prev
    offs, lens = prev.table.offset.tolist(), prev.table.length.tolist()
    for j in missing:
        step, offset = increments.holder_of(prev.runs, prev.refs, prev.step, offs[j], lens[j])
        fd = os.open(holder_file(step), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            raw = os.pread(fd, lens[j], offset)
        finally:
            os.close(fd)
        if len(raw) == lens[j]:  # short: not comparable, so the shard is written
            have[j] = increments.digest(memoryview(raw))
    return dataclasses.replace(prev, digests=have)


def _digests(computed: list[str] | None, inherited: list[str] | None) -> list[str] | None:
    """Each shard's digest as the manifest keeps it: computed now, else the base's (a
    reused shard's bytes are the base's)."""
    if computed is None:
        return inherited
    if inherited is None:
        return computed
    return [c or i for c, i in zip(computed, inherited, strict=True)]


def _nonfinite(
    req: CommitRequest,
    data: memoryview,
    layout: RankLayout,
    reused: npt.NDArray[np.bool_],
    base: Base,
) -> dict[str, int]:
    """NaN/Inf per shard: counted in the shards written, the base's for the reused."""
    own = [p for p in layout.floats if not reused[p[2]]]
    health = NonFiniteCount(req.table.keys, own)
    data_len = max((o + n for o, n in layout.ranges), default=0)
    health.feed(np.frombuffer(data, np.uint8), data_len)
    counts: dict[str, Any] = dict(health.result())
    for i in np.flatnonzero(reused).tolist():
        key = req.table.keys[i]
        if key in base.nonfinite:
            counts[key] = base.nonfinite[key]
    return {k: counts[k] for k in sorted(counts)}


def rank_file(store: LocalStore, job: str, name: str, step: int) -> Path:
    """A committed step's rank file (an incremental save's base, or its holders)."""
    return store.step_dir(job, step) / name
