"""The node's step index in the bucket: which steps of a job this node has complete there.

    <job>/_index/<node>.json

One small object per (job, node), written by that node's daemon only. It is how a
daemon learns what the bucket holds of its own steps without listing anything:
at start-up for each job it holds locally, and on the first restore or listing
of a job it does not. One GET, where a listing of ``<job>/`` returns every
node's objects of every kept step (10,000 nodes x 100 steps x 3+ objects: 3,000+
LIST pages per daemon, tens of millions when a whole job restarts; docs/scale.md).

The ``_complete`` markers stay the commit points. The index only says where to
look: a step is added after its marker is written (and before the drain calls
it DURABLE), and removed after its marker is deleted. A crash while adding
leaves a complete step out of the index: a step still local is uploaded again
at start-up (its files are found in place, only the marker and index are
rewritten). A removal flags the entry ``retracting``, then deletes the marker,
the entry and the objects (remote/retract.py): a flagged entry is never listed or
restored by a daemon of the node, and one cut short is finished between the
drain's uploads (lifecycle/replaced.py).

Buckets written before the index (no ``_index`` object) are read the slower way
once per job: the step names under ``<job>/`` (one delimited listing, O(steps),
not O(nodes x steps)) and a HEAD of this node's marker in each; the index is then
written from what was found.

The name starts with ``_``: frameworks that list ``<job>/`` for numeric step
names (Orbax) never see it, and neither does the marker parser (a marker key has
four parts).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ckptd.core.errors import InvalidArgument
from ckptd.core.manifest import DATA_LAYOUTS, DATA_SPREAD
from ckptd.core.names import UNKNOWN_OWNER, Owner, check_name, recorded_owner
from ckptd.core.timeline import MAX_TIMELINE, Forks, check_forks, check_timeline, merge

from . import records
from .base import Remote
from .layout import marker_key, parse_step_name, pin_key

log = logging.getLogger("ckptd.remote")

INDEX_DIR = "_index"
FORMAT = 1


def index_key(job: str, node: str) -> str:
    """Where ``node``'s index of ``job`` lives in the bucket."""
    return f"{job}/{INDEX_DIR}/{check_name('node', node)}.json"


@dataclass
class Entry:
    """One complete step of this node in the bucket, with what retention needs once
    the local copy is gone (the marker carries the same)."""

    step: int
    adopted: bool = False
    created_unix: float = 0.0
    milestone: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    pinned: bool = False
    timeline: int = 0
    """The job's timeline the step was saved on (core/timeline.py)."""
    forks: Forks = ()
    """The job's lineage when it was saved: how a node that lost its disk learns
    which steps a later timeline abandoned."""
    holders: list[int] = field(default_factory=list)
    """The older steps whose rank files the step's references read (retention keeps
    them in the bucket while the step is there)."""
    data_layout: int = DATA_SPREAD
    """Where its rank files are (core/manifest.py ``data_layout``); entries written
    before the field: the spread layout (or the records' prefix, deleted with them)."""
    retracting: bool = False
    """Retention is taking it out of the bucket: not a copy, whatever the marker says."""


Held = dict[tuple[int, int], int]
"""This node's held copies of a job in the bucket (remote/held.py): ``(step, timeline)``
of each, with its ``data_layout``."""


OwnerOf = Callable[[str], int | None]
"""The uid a job belongs to on this node; None: nobody's (an operator's job, open)."""
OwnerFound = Callable[[str, int | None, bool], None]
"""Called with ``(job, owner, known)`` when a job's index is read: the owner it records
(``known`` False: written before owners were recorded, so it cannot be told)."""


def encode(
    job: str,
    node: str,
    entries: dict[int, Entry],
    held: Held | None = None,
    owner: int | None = None,
) -> bytes:
    """The index object's bytes; ``owner``: the job's owner uid on the node (None:
    nobody's), what a node that lost its disk reads back (api/access.py)."""
    body: dict[str, Any] = {
        "format": FORMAT,
        "job": job,
        "node": node,
        "owner": owner,
        "steps": [asdict(e) for _, e in sorted(entries.items())],
    }
    if held:
        body["held"] = [[n, t, layout] for (n, t), layout in sorted(held.items())]
    return json.dumps(body, separators=(",", ":")).encode()


def decode(raw: bytes, key: str = "") -> dict[int, Entry]:
    """The entries of an index object (read from ``key``): :func:`decode_all`'s."""
    return decode_all(raw, key)[0]


def decode_all(raw: bytes, key: str = "") -> tuple[dict[int, Entry], Held]:
    """The entries and the held copies of an index object (read from ``key``). Bucket
    content (remote/records.py): malformed entries are skipped, logged once per key (a
    bad one must not stop the daemon); a wrong format or JSON nested past the parser's
    depth raises ValueError."""
    entries, held, _ = _decode(raw, key)
    return entries, held


def _owner(body: dict[str, Any], key: str) -> Owner:
    try:
        return recorded_owner(body)
    except ValueError as exc:
        records.skipped(key, str(exc))
        return UNKNOWN_OWNER


def _decode(raw: bytes, key: str) -> tuple[dict[int, Entry], Held, Owner]:
    body = _json(raw)
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError(f"not a ckptd step index of format {FORMAT}")
    items = body.get("steps") or []
    if not isinstance(items, list):
        raise ValueError("its steps are not a list")
    out: dict[int, Entry] = {}
    for item in items:
        entry = _entry(item)
        if entry is not None:
            out[entry.step] = entry
        else:
            records.skipped(key, f"an entry that is not a ckptd step's: {str(item)[:80]!r}")
    held: Held = {}
    raw_held = body.get("held")
    for item in raw_held if isinstance(raw_held, list) else ():
        if (
            isinstance(item, list)
            and len(item) == 3
            and all(type(v) is int for v in item)
            and 0 <= item[0] < 2**63
            and 0 <= item[1] < MAX_TIMELINE
            and item[2] in DATA_LAYOUTS
        ):
            held[(item[0], item[1])] = item[2]
        else:
            records.skipped(key, f"a held copy that is not ckptd's: {str(item)[:80]!r}")
    return out, held, _owner(body, key)


def _json(raw: bytes) -> Any:
    """Bucket bytes as JSON; ValueError for any that are not (nesting included)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested deeper than any ckptd record") from None


def _entry(item: Any) -> Entry | None:
    if not isinstance(item, dict):
        return None
    step = item.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**63:
        return None
    try:
        forks = check_forks(item.get("forks"))
        timeline = check_timeline(item.get("timeline", 0), forks)
    except InvalidArgument:
        return None  # not one ckptd wrote: a step it cannot place is not offered
    return Entry(
        step,
        adopted=item.get("adopted") is True,
        # Hints for retention: a value ckptd cannot have written is left out.
        created_unix=records.seconds_or(item.get("created_unix")),
        milestone=item.get("milestone") is True,
        metrics=records.metrics(item.get("metrics")),
        pinned=item.get("pinned") is True,
        timeline=timeline,
        forks=forks,
        holders=_holders(item.get("holders"), step),
        data_layout=layout
        if type(layout := item.get("data_layout")) is int and layout in DATA_LAYOUTS
        else DATA_SPREAD,
        retracting=item.get("retracting") is True,
    )


def _holders(raw: Any, step: int) -> list[int]:
    """An entry's holders: older steps only (anything else is not ckptd's)."""
    if not isinstance(raw, list):
        return []
    return sorted({h for h in raw if type(h) is int and 0 <= h < step})


async def bucket_lineage(remote: Remote, job: str, nodes: int = 2) -> Forks:
    """The job's forks (core/timeline.py) as the first ``nodes`` nodes' indexes record
    them: one delimited listing of ``<job>/_index/`` and a GET per index read. What a
    reader with no index of its own (a replacement node, ``ckptd pull``) needs before
    it can tell which of the highest-numbered steps a later timeline abandoned: the
    markers of those steps carry only the lineage of their own time."""
    keys = sorted(await remote.list_dirs(f"{job}/{INDEX_DIR}/"))[:nodes]
    out: Forks = ()
    for key in keys:
        try:
            entries = decode(await remote.get_bytes(key), key)
        except (FileNotFoundError, ValueError):
            continue
        out = merge(out, *(e.forks for e in entries.values()))
    return out


class NodeIndex:
    """This node's index of each job: loaded once per job, rewritten on every change.

    Changes of one job are serialised (the object is rewritten whole); the daemon is
    the only writer of its node's objects.
    """

    def __init__(
        self,
        remote: Remote,
        node: str,
        jitter_seconds: float = 0.0,
        owner_of: OwnerOf | None = None,
        owner_found: OwnerFound | None = None,
    ) -> None:
        self.remote = remote
        self.node = node
        self.owner_of: OwnerOf = owner_of or (lambda job: None)
        """Each job's owner, written into its index (api/access.py)."""
        self.owner_found: OwnerFound = owner_found or (lambda job, owner, known: None)
        """Told the owner an index of a job with steps records when it is read."""
        self.jitter_seconds = jitter_seconds
        """Most random wait before a job's first read (``remote_read_jitter_seconds``)."""
        self._jobs: dict[str, dict[int, Entry]] = {}
        self._held: dict[str, Held] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._written: dict[str, float] = {}
        self._removing: set[tuple[str, int]] = set()

    def _lock(self, job: str) -> asyncio.Lock:
        return self._locks.setdefault(job, asyncio.Lock())

    def known(self, job: str) -> bool:
        """Whether ``job``'s index has been read (or built) in this daemon's life."""
        return job in self._jobs

    async def entries(self, job: str) -> dict[int, Entry]:
        """``job``'s complete steps of this node in the bucket (read once, then kept)."""
        async with self._lock(job):
            return dict(await self._load(job))

    async def add(self, job: str, entry: Entry) -> None:
        """Record a step whose marker is written (call before announcing it DURABLE)."""
        async with self._lock(job):
            entries = await self._load(job)
            if entries.get(entry.step) != entry:
                await self._put(job, {**entries, entry.step: entry})

    async def remove(self, job: str, step: int) -> None:
        """Forget a step (after its marker is deleted, before its objects are)."""
        async with self._lock(job):
            entries = await self._load(job)
            if step in entries:
                await self._put(job, {n: e for n, e in entries.items() if n != step})

    async def flag_retracting(self, job: str, step: int) -> None:
        """Flag ``step``'s entry before its marker goes (retract.py)."""
        async with self._lock(job):
            entries = await self._load(job)
            if (entry := entries.get(step)) is not None and not entry.retracting:
                await self._put(job, {**entries, step: replace(entry, retracting=True)})

    async def _put(self, job: str, entries: dict[int, Entry]) -> None:
        """Write ``entries`` as ``job``'s index, then know them (a failed write: as was)."""
        await self._write(job, entries)
        self._jobs[job] = entries

    @contextlib.contextmanager
    def removing(self, job: str, step: int) -> Iterator[None]:
        """Held while this daemon takes ``step``'s copy out of the bucket (entered before
        any wait: a fetch that starts meanwhile is refused, source.py)."""
        self._removing.add((job, step))
        try:
            yield
        finally:
            self._removing.discard((job, step))

    def retracting(self, job: str, step: int) -> bool:
        """Whether ``step``'s copy is being (or was partly) taken out of the bucket."""
        return (job, step) in self._removing or self.flagged(job, step)

    def flagged(self, job: str, step: int) -> bool:
        """Whether ``step``'s entry is flagged in the bucket (a removal to finish)."""
        entry = self._jobs.get(job, {}).get(step)
        return entry is not None and entry.retracting

    def cut_short(self) -> list[tuple[str, Entry]]:
        """Flagged entries of the jobs read so far whose removal no one is doing now."""
        return [
            (job, e)
            for job, es in self._jobs.items()
            for e in es.values()
            if e.retracting and (job, e.step) not in self._removing
        ]

    async def held(self, job: str) -> Held:
        """``job``'s held copies of this node in the bucket (remote/held.py)."""
        async with self._lock(job):
            await self._load(job)
            return dict(self._held.get(job, {}))

    def held_now(self, job: str) -> frozenset[tuple[int, int]]:
        """:meth:`held` as known now, without reading the bucket (empty if unread)."""
        return frozenset(self._held.get(job, {}))

    async def add_held(self, job: str, step: int, timeline: int, layout: int) -> None:
        """Record a held copy (before its step's marker and records go)."""
        async with self._lock(job):
            entries = await self._load(job)
            held = self._held.setdefault(job, {})
            if held.get((step, timeline)) != layout:
                held[(step, timeline)] = layout
                await self._write(job, entries)

    async def remove_held(self, job: str, step: int, timeline: int) -> None:
        """Forget a held copy (after its objects are deleted)."""
        async with self._lock(job):
            entries = await self._load(job)
            if self._held.get(job, {}).pop((step, timeline), None) is not None:
                await self._write(job, entries)

    async def set_pinned(self, job: str, step: int, pinned: bool) -> None:
        """Record a pin in the entry of ``step``, if this node has one."""
        async with self._lock(job):
            entries = await self._load(job)
            entry = entries.get(step)
            if entry is not None and entry.pinned != pinned:
                entry.pinned = pinned
                await self._write(job, entries)

    async def _write(self, job: str, entries: dict[int, Entry]) -> None:
        # GCS takes about one write a second to one object name (429s past that).
        wait = self._written.get(job, -math.inf) + self.remote.rewrite_seconds - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        body = encode(job, self.node, entries, self._held.get(job), self.owner_of(job))
        await self.remote.put_bytes(index_key(job, self.node), body)
        self._written[job] = time.monotonic()

    async def _load(self, job: str) -> dict[int, Entry]:
        found = self._jobs.get(job)
        if found is not None:
            return found
        if self.jitter_seconds > 0:  # a whole job restarting: not all in the same second
            await asyncio.sleep(random.uniform(0, self.jitter_seconds))
        owner: Owner = UNKNOWN_OWNER
        try:
            raw = await self.remote.get_bytes(index_key(job, self.node))
        except FileNotFoundError:
            found = await self._from_markers(job)
        else:
            try:
                found, held, owner = _decode(raw, index_key(job, self.node))
                self._held[job] = held
            except ValueError as exc:  # unreadable: rebuilt from the markers
                log.warning("%s: unreadable step index (%s); rebuilding it", job, exc)
                found = await self._from_markers(job)
        self._jobs[job] = found
        if found:
            self.owner_found(job, *owner)
        return found

    async def _from_markers(self, job: str) -> dict[int, Entry]:
        """A bucket written before the index (or a job new to it): the step names under
        ``<job>/``, then this node's marker in each; written as the index if any."""
        names = await self.remote.list_dirs(f"{job}/")
        steps = [parsed for parsed in map(parse_step_name, names) if parsed[0] is not None]
        if not steps:
            return {}
        limit = asyncio.Semaphore(16)

        async def marker(step: int, adopted: bool) -> Entry | None:
            async with limit:
                try:
                    raw = await self.remote.get_bytes(marker_key(job, step, self.node, adopted))
                except FileNotFoundError:
                    return None
            return marker_entry(step, adopted, raw)

        got = await asyncio.gather(*(marker(s, a) for s, a in steps if s is not None))
        entries = {e.step: e for e in got if e is not None}

        async def pinned(e: Entry) -> None:
            async with limit:
                e.pinned = await self.remote.exists(pin_key(job, e.step, e.adopted))

        await asyncio.gather(*(pinned(e) for e in entries.values()))
        if entries:
            log.info(
                "%s: no step index of node %s in the bucket; built one from %d markers",
                job,
                self.node,
                len(entries),
            )
            await self._write(job, entries)
        return entries


def marker_entry(step: int, adopted: bool, raw: bytes) -> Entry:
    """An entry from a marker's JSON (bucket content: wrong types and values out of
    bounds are ignored, remote/records.py; the marker itself is the commit point)."""
    try:
        meta = _json(raw)
    except ValueError:
        meta = {}
    meta = meta if isinstance(meta, dict) else {}
    entry = _entry({**meta, "step": step, "adopted": adopted})
    if entry is None:  # a marker whose timeline fields are not ckptd's
        entry = _entry({"step": step, "adopted": adopted})
    assert entry is not None
    if not entry.created_unix:
        entry.created_unix = records.seconds_or(meta.get("time"))
    return entry
