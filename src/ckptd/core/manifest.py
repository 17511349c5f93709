"""``manifest.json``: what a committed step holds, with a crc32c per shard."""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from . import increments
from .errors import DataLoss, InvalidArgument
from .names import MAX_NAME_BYTES, check_name, check_shard_key, check_step, check_tree_path
from .shard_table import ShardTable, empty_table
from .timeline import Forks, check_forks, check_timeline, timeline_at

FORMAT_VERSION = 2
"""2: shards as columns (:class:`ShardTable`); 1: one JSON object per shard (still read)."""
READABLE_VERSIONS = (1, 2)
_TEXT = "_json_text"
"""Where a manifest caches its serialised text (see :meth:`Manifest.to_json`)."""
MANIFEST = "manifest.json"
"""The file name of a step's manifest: the last file written before its commit point."""
KIND_ARRAYS = "arrays"
DATA_BY_STEP = 1
DATA_SPREAD = 2
DATA_TIMELINE = 3
DATA_LAYOUTS = (DATA_BY_STEP, DATA_SPREAD, DATA_TIMELINE)
KIND_DIRECTORY = "directory"
TREE_PREFIX = "files/"
"""Every file of an adopted tree is recorded as ``files/<its path in the tree>``."""
_INCREMENTAL = frozenset({"runs", "refs", "image_size", "image_crc32c", "digests"})
"""A rank record's fields only an incremental file has (written only when set)."""
MAX_WORLD_SIZE = 2**24
MAX_FILE_BYTES = 2**62
MAX_UNIX = 2.0**35  # the year 3058: every time a record carries is finite and in [0, this)


class ManifestInvalid(DataLoss, ValueError):
    """A manifest ckptd could not have written: a file name that would leave its step
    directory, a name or step that is not valid, offsets outside their file, ranks out
    of range. The copy it describes is corrupt (a :class:`DataLoss`: restore serves an
    older step); a ``ValueError`` too, which is what readers that set aside unreadable
    manifests catch."""


class RawJson(str):
    """JSON text already parsed once and checked (a commit's tree spec): written into
    the manifest as it came, not parsed into objects only to be written back. A
    manifest read back from disk holds the parsed value instead."""


def rank_file_name(rank: int) -> str:
    """File name of one rank's shards inside a step directory."""
    return f"rank-{rank:05d}.safetensors"


@dataclass(frozen=True)
class ShardRecord:
    """One array shard: where it sits in the global array and in its file."""

    key: str
    rank: int
    dtype: str
    shape: list[int]
    global_shape: list[int]
    index: list[list[int]]
    file: str
    offset: int
    """Absolute byte offset of the shard's data in ``file``."""
    length: int
    crc32c: int


@dataclass(frozen=True)
class RankRecord:
    """One rank's file and its pytree structure (with its non-array leaves)."""

    rank: int
    file: str
    size: int
    crc32c: int
    """crc32c of the whole file, as object stores report it."""
    tree: Any
    runs: list[list[int]] | None = None
    """An incremental file (core/increments.py): the image ranges it holds, ``[start,
    length]`` each in file order; None: the file is the whole image."""
    refs: list[list[int]] | None = None
    """An incremental file's other image ranges, each held by an older step's file:
    ``[start, length, step, offset there, crc32c]``."""
    image_size: int | None = None
    """An incremental file's image: its size and crc32c (a full file's are its own)."""
    image_crc32c: int | None = None
    digests: list[str] | None = None
    """Each shard's strong digest, in the rank's table order (``""``: not computed),
    where an incremental save computed or inherited them."""

    @property
    def image_bytes(self) -> int:
        """Bytes of the rank's image (the file a full save would have written)."""
        return self.size if self.image_size is None else self.image_size

    @property
    def image_crc(self) -> int:
        """crc32c of the rank's image."""
        return self.crc32c if self.image_crc32c is None else self.image_crc32c

    @property
    def incremental(self) -> bool:
        """The file holds only some of the image (the rest in older steps' files)."""
        return self.runs is not None

    def holders(self) -> set[int]:
        """The older steps whose files this rank's references read."""
        return {int(r[2]) for r in self.refs or ()}


@dataclass(frozen=True)
class Manifest:
    """The commit record of one step on one node."""

    job: str
    step: int
    node: str
    world_size: int
    created_unix: float
    ranks: list[RankRecord]
    shards: ShardTable = field(default_factory=empty_table)
    """The shards as columns (a list of :class:`ShardRecord` is converted)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    milestone: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    kind: str = "arrays"
    """``arrays``: rank files written by ckptd; ``directory``: a tree adopted as it was
    (an Orbax step, ``ckptd adopt``), one record in ``ranks`` per file under ``files/``."""
    source: str = ""
    """For an adopted tree: the directory it was adopted from."""
    nonfinite: dict[str, dict[str, int]] | None = None
    """Per rank (its number as text), the shards holding NaN or Inf and how many
    (``{}``: all finite); None where not counted (an older ckptd, an adopted tree).
    The total is the metric ``ckptd.nonfinite`` (core/health.py)."""
    data_layout: int = DATA_BY_STEP
    """Where the bucket copy's rank files are: 1 beside the manifest, 2 under a per-node
    prefix, 3 that prefix by step and timeline (daemon/remote/layout.py)."""
    timeline: int = 0
    """The job's timeline this step was saved on (core/timeline.py)."""
    increment: int = 0
    """Saves since the last full one in this step's chain of references (0: no rank
    file references an older step)."""
    forks: Forks = ()
    """The job's lineage when this step was saved: ``(timeline, first step)`` of every
    timeline after the first (core/timeline.py)."""
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if isinstance(self.shards, list):  # records given one each: held as columns
            object.__setattr__(self, "shards", _table_of(self.shards))

    @property
    def adopted(self) -> bool:
        """An adopted directory tree rather than ckptd's own rank files."""
        return self.kind == KIND_DIRECTORY

    def shard_records(self) -> list[ShardRecord]:
        """The shards one record each (built on demand: readers of a few shards)."""
        files = {r.rank: r.file for r in self.ranks}
        return [ShardRecord(*row) for row in self.shards.rows(files)]

    @property
    def size_bytes(self) -> int:
        """Bytes of all rank files."""
        return sum(r.size for r in self.ranks)

    @property
    def image_bytes(self) -> int:
        """Bytes of every rank's image (what a restore hands over)."""
        return sum(r.image_bytes for r in self.ranks)

    def holders(self) -> set[int]:
        """The older steps whose files this step's references read (each tier that
        holds this step must hold them)."""
        return {s for r in self.ranks for s in r.holders()}

    def holder_timelines(self) -> dict[int, int]:
        """Each holder's number and timeline (the save under that number on this step's
        own history: a later timeline may have replaced it, core/timeline.py)."""
        return {n: timeline_at(n, self.timeline, self.forks) for n in self.holders()}

    def to_json(self) -> str:
        """Serialise: compact, stable key order (equal manifests are equal bytes), and
        once per manifest: it is immutable, so the commit, every Restore answer and
        the upload share one text (one read from JSON keeps the text it was read from).
        ``dataclasses.asdict`` with ``indent=1`` took 98 ms for 1,521 shards; the
        columns of format version 2 are a few flat lists."""
        text: str | None = self.__dict__.get(_TEXT)
        if text is None:
            plain = self._plain()
            # Parts that are JSON text already (a tree spec as the client sent it, the
            # shard columns: ShardTable.columns_json) go in as they are: a placeholder
            # string (unguessable, so no value in the manifest can spell it) is
            # replaced by the text once the rest is serialised.
            token = f"\0{secrets.token_hex(8)}:"
            raw: list[str] = []

            def hold(value: str) -> str:
                raw.append(value)
                return f"{token}{len(raw) - 1}"

            for rank in plain["ranks"]:
                if isinstance(rank["tree"], RawJson):
                    rank["tree"] = hold(rank["tree"])
            plain["shards"] = {k: hold(v) for k, v in self.shards.columns_json().items()}
            text = json.dumps(plain, separators=(",", ":"), sort_keys=True)
            quoted = re.escape(json.dumps(token)[:-1]) + r'(\d+)"'  # '"\u0000...:N"'
            text = re.sub(quoted, lambda m: raw[int(m.group(1))], text)  # one pass
            self.__dict__[_TEXT] = text  # a cache, not a field: frozen stays frozen
        return text

    def _plain(self) -> dict[str, Any]:
        """The manifest as JSON types, sharing (not copying) the records' values."""
        plain = {f.name: getattr(self, f.name) for f in fields(self)}
        # A full file's record has no incremental fields: its text stays what every
        # ckptd wrote (and reads).
        plain["ranks"] = [
            {k: v for k, v in vars(r).items() if v is not None or k not in _INCREMENTAL}
            for r in self.ranks
        ]
        plain["shards"] = None  # to_json writes the columns' own text
        plain["format_version"] = FORMAT_VERSION
        return plain

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse and check a manifest; raises ValueError if it is not one of ours."""
        try:
            raw = json.loads(text)
            version = raw.get("format_version")
            if version not in READABLE_VERSIONS:
                raise ValueError(f"unsupported format_version {version!r}; upgrade ckptd")
            ranks = [RankRecord(**r) for r in raw["ranks"]]
            manifest = cls(
                job=str(raw["job"]),
                step=int(raw["step"]),
                node=str(raw["node"]),
                world_size=int(raw["world_size"]),
                created_unix=float(raw["created_unix"]),
                ranks=ranks,
                shards=ShardTable.from_plain(raw["shards"]) if version == 2 else empty_table(),
                metadata=dict(raw.get("metadata") or {}),
                milestone=bool(raw.get("milestone", False)),
                metrics={str(k): float(v) for k, v in (raw.get("metrics") or {}).items()},
                kind=str(raw.get("kind", KIND_ARRAYS)),
                source=str(raw.get("source", "")),
                nonfinite=raw.get("nonfinite"),  # checked below
                data_layout=raw.get("data_layout", DATA_BY_STEP),  # checked: an int
                timeline=raw.get("timeline", 0),  # checked below
                increment=raw.get("increment", 0),  # checked below
                forks=check_forks(raw.get("forks")),
                format_version=version,
            )
            if version == 1:
                # The ranks first (a shard's file is checked against them), then the
                # shards, one object each, as that version wrote them.
                manifest.check()
                object.__setattr__(manifest, "shards", _v1_shards(raw["shards"], ranks))
        except InvalidArgument as exc:
            raise ManifestInvalid(f"malformed manifest: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            raise ManifestInvalid(f"malformed manifest: {exc!r}") from None
        manifest.check()
        manifest.__dict__[_TEXT] = text
        return manifest

    def check(self) -> Manifest:
        """Check every field a path, an offset or a rank is made from (returns ``self``).

        Manifests come from disk and from the bucket, so nothing in one is trusted:
        a file name must be one path component (``rank-00000.safetensors``) or, in
        an adopted tree, a relative path under ``files/`` whose every component is
        a plain name; shard ranges must lie inside their file. Raises
        :class:`ManifestInvalid` naming the field.
        """
        where = f"manifest of {str(self.job)[:80]!r} step {str(self.step)[:40]}"
        try:
            _check(self)
        except InvalidArgument as exc:
            raise ManifestInvalid(f"{where}: {exc}") from None
        return self


def _field(name: str, value: Any, kind: type | tuple[type, ...]) -> None:
    """``value`` must be of ``kind`` (a bool is not an int here)."""
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise InvalidArgument(f"{name} is {type(value).__name__}, not {kind}")


def _count(name: str, value: Any, below: int) -> int:
    """An integer in ``[0, below)``."""
    _field(name, value, int)
    if not 0 <= value < below:
        raise InvalidArgument(f"{name} = {value} is outside [0, {below})")
    return int(value)


def _named(name: str, check: Any, value: Any) -> None:
    _field(name, value, str)
    try:
        check(value)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{name}: {exc}") from None


def _check(m: Manifest) -> None:
    if m.format_version not in READABLE_VERSIONS:
        raise InvalidArgument(f"unsupported format_version {m.format_version!r}; upgrade ckptd")
    if m.kind not in (KIND_ARRAYS, KIND_DIRECTORY):
        raise InvalidArgument(f"unknown kind {m.kind!r}; upgrade ckptd")
    _field("data_layout", m.data_layout, int)
    if m.nonfinite is not None:
        _field("nonfinite", m.nonfinite, dict)
        for rank, counts in m.nonfinite.items():
            _field(f"nonfinite[{str(rank)[:20]!r}]", counts, dict)
            for key, n in counts.items():
                _field(f"nonfinite[{str(rank)[:20]!r}] key", key, str)
                _count(f"nonfinite[{str(rank)[:20]!r}][{key[:80]!r}]", n, 2**63)
    if m.data_layout not in DATA_LAYOUTS:
        raise InvalidArgument(f"unknown data_layout {m.data_layout!r}; upgrade ckptd")
    check_timeline(m.timeline, m.forks)
    _count("increment", m.increment, 2**31)
    # Job names up to 255 bytes were accepted before the 128-byte limit: their copies
    # stay readable (not set aside at start-up), though no call can name them now.
    _named("job", lambda v: check_name("job", v, MAX_NAME_BYTES), m.job)
    _named("node", lambda v: check_name("node", v), m.node)
    _field("step", m.step, int)
    check_step(m.step)
    world = _count("world_size", m.world_size, MAX_WORLD_SIZE + 1)
    if world < 1:
        raise InvalidArgument("world_size is 0")
    if not (math.isfinite(m.created_unix) and 0 <= m.created_unix < MAX_UNIX):
        raise InvalidArgument(f"created_unix = {m.created_unix} is not a time")
    _field("ranks", m.ranks, list)
    _field("shards", m.shards, ShardTable)
    files: dict[str, RankRecord] = {}
    ranks: set[int] = set()
    for i, r in enumerate(m.ranks):
        at = f"ranks[{i}]"
        # An adopted tree numbers its files; ckptd's own rank files are one per rank.
        _count(f"{at}.rank", r.rank, MAX_FILE_BYTES if m.adopted else world)
        _count(f"{at}.size", r.size, MAX_FILE_BYTES)
        _count(f"{at}.crc32c", r.crc32c, 2**32)
        if m.adopted:
            _named(f"{at}.file", _tree_file, r.file)
        else:
            _named(f"{at}.file", lambda v: check_name("file", v), r.file)
            if r.rank in ranks:
                raise InvalidArgument(f"{at}.rank {r.rank} appears twice")
            ranks.add(r.rank)
        if r.file in files:
            raise InvalidArgument(f"{at}.file {r.file!r} appears twice")
        files[r.file] = r
    if m.adopted:
        _no_file_is_a_directory(files)
        if len(m.shards):
            raise InvalidArgument("an adopted tree has no shards")
        return
    t = m.shards
    t.check(placed=True)
    for r in m.ranks:
        increments.check_rank(m.step, r, t)
    size_of = {r.rank: r.image_bytes for r in m.ranks}
    try:
        sizes = np.fromiter(map(size_of.__getitem__, t.rank.tolist()), np.int64, len(t))
    except KeyError as exc:
        raise InvalidArgument(
            f"a shard names rank {exc.args[0]!r}, which has no file here"
        ) from None
    past = np.flatnonzero(t.offset + t.length > sizes)
    if len(past):
        i = int(past[0])
        raise InvalidArgument(
            f"shard {t.keys[i]!r} [{int(t.offset[i])}, {int(t.offset[i] + t.length[i])}) ends "
            f"past the file of rank {int(t.rank[i])} ({int(sizes[i])} bytes)"
        )


def _v1_shards(raw: Any, ranks: list[RankRecord]) -> ShardTable:
    """Format version 1's shards (one object each) as a table, each field checked as
    that version was: the file a shard names must be its rank's."""
    _field("shards", raw, list)
    files = {r.file: r for r in ranks if isinstance(r, RankRecord)}
    records = [ShardRecord(**s) for s in raw]
    for i, s in enumerate(records):
        at = f"shards[{i}]"
        _named(f"{at}.key", check_shard_key, s.key)
        _field(f"{at}.file", s.file, str)
        record = files.get(s.file)
        if record is None or record.rank != s.rank:
            raise InvalidArgument(f"{at} names {s.file!r} of rank {s.rank!r}, not a file here")
        _field(f"{at}.dtype", s.dtype, str)
        for name in ("shape", "global_shape", "index"):
            _field(f"{at}.{name}", getattr(s, name), list)
        if len(s.global_shape) != len(s.shape) or len(s.index) != len(s.shape):
            raise InvalidArgument(f"{at}: shape, global_shape and index differ in length")
        for pair in s.index:
            _field(f"{at}.index", pair, list)
            if len(pair) != 2:
                raise InvalidArgument(f"{at}.index holds {pair!r}, not [start, stop]")
            for v in pair:
                _field(f"{at}.index", v, int)
        for name in ("offset", "length", "crc32c"):
            _field(f"{at}.{name}", getattr(s, name), int)
    return _table_of(records)


def _table_of(records: list[ShardRecord]) -> ShardTable:
    """Shard records as a table (unchecked: :meth:`Manifest.check` does that)."""
    return ShardTable.from_plain(
        {
            "key": [s.key for s in records],
            "dtype": [s.dtype for s in records],
            "ndim": [len(s.shape) for s in records],
            "shape": [d for s in records for d in s.shape],
            "global_shape": [d for s in records for d in s.global_shape],
            "start": [p[0] for s in records for p in s.index],
            "offset": [s.offset for s in records],
            "length": [s.length for s in records],
            "rank": [s.rank for s in records],
            "crc32c": [s.crc32c for s in records],
        }
    )


def _tree_file(value: str) -> None:
    """``files/<relative path>``: where an adopted file sits in the step directory."""
    if not value.startswith(TREE_PREFIX):
        raise InvalidArgument(f"adopted file {value[:80]!r} is not under {TREE_PREFIX}")
    check_tree_path("adopted file", value)


def _no_file_is_a_directory(files: dict[str, RankRecord]) -> None:
    """No file of a tree is also a directory of another (``files/a`` and ``files/a/b``)."""
    for name in files:
        parent = name.rsplit("/", 1)[0]
        while "/" in parent:
            if parent in files:
                raise InvalidArgument(f"{parent!r} is both a file and the directory of {name!r}")
            parent = parent.rsplit("/", 1)[0]
