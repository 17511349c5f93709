"""The shard reader every restore uses: a step's rank files mapped, each shard served as a
verified view, and any block of a leaf's global array assembled from the saved shards
that overlap it (another sharding, mesh or device count than the one that saved).

It reads bytes only: numpy arrays, torch tensors and jax arrays are built from its
views by their own code (restore_flow.py, torch/reader.py, leaves/jax_arrays.py).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ckptd.core import checksum
from ckptd.core.errors import NotFound
from ckptd.core.format import str_to_dtype
from ckptd.core.shard_table import rows

from .rank_files import Holders, Locator


def leaf_of(shard_key: str) -> str:
    """The leaf key a shard key belongs to (``w#3`` -> ``w``)."""
    return shard_key.rsplit("#", 1)[0]


def _relative(
    cut: list[tuple[int, int]], origin: list[tuple[int, int]] | tuple[tuple[int, int], ...]
) -> tuple[slice, ...]:
    """``cut`` (global bounds) as slices relative to a block starting at ``origin``."""
    return tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(cut, origin, strict=True))


class CorruptShard(Exception):
    """A saved shard failed its crc32c check."""


class MissingShards(LookupError):
    """The parts read so far do not cover a requested block (other nodes saved it)."""


class ShardReader:
    """Maps the rank files of a step (this node's part, and other nodes' parts
    when added) and serves verified shard views."""

    def __init__(
        self,
        directory: str,
        manifest: dict[str, Any],
        opener: Callable[[str], int] = lambda path: os.open(path, os.O_RDONLY | os.O_CLOEXEC),
        holders: Holders | None = None,
    ) -> None:
        self.opener = opener
        """Opens a rank file read-only (the session hands over ones this user may not)."""
        self._by_leaf: dict[str, list[dict[str, Any]]] = {}
        self._unindexed: list[tuple[str, dict[str, Any], bool, Holders | None]] = []
        self.parts = 0
        self.add_part(directory, manifest, holders=holders)
        self._maps: dict[str, mmap.mmap] = {}
        self._verified: set[tuple[str, str]] = set()
        self._adopted: dict[tuple[int, str], np.ndarray] = {}

    def add_part(
        self,
        directory: str,
        manifest: dict[str, Any],
        part: bool = False,
        holders: Holders | None = None,
    ) -> None:
        """Make one node's part of the step readable (``part``: another node's, fetched
        for this restore; where its incremental ranks' holders are: rank_files.py,
        or ``holders``, as the daemon said)."""
        self.parts += 1
        self._unindexed.append((directory, manifest, part, holders))

    @property
    def by_leaf(self) -> dict[str, list[dict[str, Any]]]:
        """Each saved leaf's shards across the parts added; built when first asked
        for, so a restore that needs no resharding pays nothing per shard here."""
        while self._unindexed:
            directory, manifest, part, holders = self._unindexed.pop(0)
            files = Locator(directory, manifest, part, holders)
            for s in rows(manifest):
                # "offset": in the file holding the shard (an incremental rank's
                # manifest records it in the rank's image).
                path, offset = files.locate(s)
                held = path != os.path.join(directory, s["file"])
                shard = {**s, "path": path, "offset": offset, "held": held}
                self._by_leaf.setdefault(leaf_of(s["key"]), []).append(shard)
        return self._by_leaf

    def adopt(self, rank: int, views: dict[str, np.ndarray]) -> None:
        """Already-verified views of ``rank``'s shards (the restore's own buffer):
        used instead of reading and checking its file again. Ranks are global, so
        ``(rank, key)`` names one shard across every node's part."""
        for key, arr in views.items():
            self._adopted[(rank, key)] = arr

    def view(self, s: dict[str, Any]) -> np.ndarray:
        """The shard's data as an array over the mapped file, verified once."""
        adopted = self._adopted.get((s["rank"], s["key"]))
        if adopted is not None:
            return adopted
        mm = self._maps.get(s["path"])
        if mm is None:
            try:
                fd = self.opener(s["path"])
            except (FileNotFoundError, NotFound):
                if not s.get("held"):
                    raise
                # An older step's file an incremental rank references: without it the
                # step cannot be read here, as if corrupt (another copy is asked for).
                raise CorruptShard(
                    f"{s['path']}, which holds shard {s['key']!r}, is missing"
                ) from None
            try:
                mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._maps[s["path"]] = mm
        if s["offset"] + s["length"] > len(mm):
            raise CorruptShard(f"{s['path']} ends before shard {s['key']!r}")
        flat = np.frombuffer(mm, np.uint8, count=s["length"], offset=s["offset"])
        if (s["path"], s["key"]) not in self._verified:
            crc = checksum.value(flat)
            if crc != s["crc32c"]:
                raise CorruptShard(
                    f"shard {s['key']!r} in {s['path']} has crc32c {crc:#010x}, "
                    f"expected {s['crc32c']:#010x}"
                )
            self._verified.add((s["path"], s["key"]))
        return flat.view(str_to_dtype(s["dtype"])).reshape(s["shape"])

    def assemble(
        self, leaf: str, want: list[tuple[int, int]], dtype: np.dtype, view_ok: bool = False
    ) -> np.ndarray:
        """The block ``want`` (start, stop per dimension) of a leaf's global array.

        A block that is exactly one saved shard (restoring onto the sharding that
        saved) is that shard's verified view, not a copy: fresh memory is the
        slow part of a restore on these machines. Only with ``view_ok`` (jax
        copies it or holds it immutably; a numpy leaf handed to the caller must
        stay writable).
        """
        exact = tuple(want)
        for s in self.by_leaf.get(leaf, []) if view_ok else ():
            if tuple((int(a), int(b)) for a, b in s["index"]) == exact:
                return self.view(s)
        out = np.empty([b - a for a, b in want], dtype)
        needed = math.prod(out.shape)
        seen: set[tuple[tuple[int, int], ...]] = set()
        copied = 0
        for s in self.by_leaf.get(leaf, []):
            index = tuple((int(a), int(b)) for a, b in s["index"])
            if index in seen:
                continue  # a replica of a shard already used
            cut = [(max(a, wa), min(b, wb)) for (a, b), (wa, wb) in zip(index, want, strict=True)]
            if any(lo >= hi for lo, hi in cut) and needed:
                continue
            seen.add(index)
            src = self.view(s)[_relative(cut, index)]
            out[_relative(cut, want)] = src
            copied += src.size
        if copied < needed:
            raise MissingShards(
                f"the {self.parts} node part(s) of this checkpoint readable here hold only part "
                f"of {leaf!r}[{want}]; the rest was saved on other nodes. Configure the daemon's "
                "remote tier (their parts are fetched from the bucket), or restore onto the "
                "sharding that saved it"
            )
        return out

    def close(self) -> None:
        """Unmap the files (arrays built from them are copies)."""
        for mm in self._maps.values():
            with contextlib.suppress(BufferError):  # still viewed: the GC unmaps it
                mm.close()
        self._maps.clear()
        self._adopted.clear()


def global_shape_of(reader: ShardReader, leaf: str) -> tuple[int, ...]:
    """The global shape recorded for a leaf's shards."""
    shards = reader.by_leaf.get(leaf)
    if not shards:  # (MissingShards: the restore asks the other nodes' parts for it)
        raise MissingShards(f"no shards of {leaf!r} in the part(s) of this checkpoint read here")
    return tuple(int(d) for d in shards[0]["global_shape"])
