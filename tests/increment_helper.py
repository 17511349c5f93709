"""Hand-built incremental steps (core/increments.py) for tests of the tiers that keep,
check and move them, made from a full step a real save committed: the rank files
hold the header and the changed shards only, and reference the full step for the
rest, as an incremental save writes them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ckptd.core import checksum, increments
from ckptd.core.manifest import MANIFEST, Manifest


def make_incremental(
    root: Path, job: str, base: int, step: int, change: str = "w1"
) -> tuple[Manifest, dict[str, bytes]]:
    """Commit ``step`` of ``job`` under local root ``root``: ``base``'s files with shard
    ``change`` altered (every byte inverted), written as an incremental step whose
    other shards are references into ``base``. Returns its manifest and each rank
    file's image (what a restore must assemble, bit for bit)."""
    base_dir = root / job / str(base)
    full = Manifest.from_json((base_dir / MANIFEST).read_text())
    crcs = full.shards.crc32c.copy()
    ranks, images = [], {}
    out = root / job / str(step)
    out.mkdir(parents=True)
    for record in full.ranks:
        assert record.runs is None, "the base must be a full step"
        image = bytearray((base_dir / record.file).read_bytes())
        rows = np.flatnonzero(full.shards.rank == record.rank)
        old = full.shards.of_rank(record.rank)
        for row in rows:
            if full.shards.keys[row] == change:
                at, n = int(full.shards.offset[row]), int(full.shards.length[row])
                image[at : at + n] = bytes(b ^ 0xFF for b in image[at : at + n])
                crcs[row] = checksum.value(bytes(image[at : at + n]))
        new = dataclasses.replace(old, crc32c=crcs[rows].copy())
        prev = increments.Previous(base, None, [], old, None)
        claimed = np.ones(len(new), bool)
        reused, refs, _ = increments.reuse(new, new.crc32c.tolist(), prev, claimed, None)
        header = int(new.offset.min())
        runs = increments.round_runs(increments.own_ranges(header, new, reused), len(image))
        data = b"".join(bytes(image[s : s + n]) for s, n in runs)
        (out / record.file).write_bytes(data)
        images[record.file] = bytes(image)
        ranks.append(
            dataclasses.replace(
                record,
                size=len(data),
                crc32c=checksum.value(data),
                runs=[[s, n] for s, n in runs],
                refs=[r.as_list() for r in refs],
                image_size=len(image),
                image_crc32c=checksum.value(bytes(image)),
            )
        )
    shards = dataclasses.replace(full.shards, crc32c=crcs)
    m = dataclasses.replace(full, step=step, ranks=ranks, shards=shards, increment=1)
    text = m.to_json()
    m = Manifest.from_json(text)  # checked as any reader checks it
    (out / MANIFEST).write_text(text)
    return m, images


def shard_range(m: Manifest, key: str) -> tuple[int, int]:
    """``(image offset, length)`` of shard ``key`` (rank 0's)."""
    i = m.shards.keys.index(key)
    return int(m.shards.offset[i]), int(m.shards.length[i])
