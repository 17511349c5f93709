"""``manifest.json``: what a committed step holds, with a crc32c per shard."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
"""The file name of a step's manifest: the last file written before its commit point."""
KIND_ARRAYS = "arrays"
KIND_DIRECTORY = "directory"


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


@dataclass(frozen=True)
class Manifest:
    """The commit record of one step on one node."""

    job: str
    step: int
    node: str
    world_size: int
    created_unix: float
    ranks: list[RankRecord]
    shards: list[ShardRecord]
    metadata: dict[str, Any] = field(default_factory=dict)
    milestone: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    kind: str = "arrays"
    """``arrays``: rank files written by ckptd; ``directory``: a tree adopted as it was
    (an Orbax step, ``ckptd adopt``), one record in ``ranks`` per file under ``files/``."""
    source: str = ""
    """For an adopted tree: the directory it was adopted from."""
    format_version: int = FORMAT_VERSION

    @property
    def adopted(self) -> bool:
        """An adopted directory tree rather than ckptd's own rank files."""
        return self.kind == KIND_DIRECTORY

    @property
    def size_bytes(self) -> int:
        """Bytes of all rank files."""
        return sum(r.size for r in self.ranks)

    def to_json(self) -> str:
        """Serialise (stable key order, so equal manifests are equal bytes)."""
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse and check a manifest; raises ValueError if it is not one of ours."""
        try:
            raw = json.loads(text)
            if raw.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"unsupported format_version {raw.get('format_version')!r}")
            manifest = cls(
                job=str(raw["job"]),
                step=int(raw["step"]),
                node=str(raw["node"]),
                world_size=int(raw["world_size"]),
                created_unix=float(raw["created_unix"]),
                ranks=[RankRecord(**r) for r in raw["ranks"]],
                shards=[ShardRecord(**s) for s in raw["shards"]],
                metadata=dict(raw.get("metadata") or {}),
                milestone=bool(raw.get("milestone", False)),
                metrics={str(k): float(v) for k, v in (raw.get("metrics") or {}).items()},
                kind=str(raw.get("kind", KIND_ARRAYS)),
                source=str(raw.get("source", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed manifest: {exc!r}") from None
        if manifest.kind not in (KIND_ARRAYS, KIND_DIRECTORY):
            raise ValueError(f"unknown manifest kind {manifest.kind!r}; upgrade ckptd")
        return manifest
