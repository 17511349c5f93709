"""Incremental steps made by hand on a stopped daemon's disk (core/increments.py), for
tests of the tiers' rules with references before the save path writes them itself."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ckptd.core import checksum
from ckptd.core.format import ALIGN
from ckptd.core.increments import Ref
from ckptd.core.manifest import MANIFEST, Manifest


def make_incremental(root: Path, job: str, step: int, holder: int) -> Manifest:
    """Turn committed step ``step`` of ``job`` under ``root`` into an incremental step
    whose every shard is a reference to ``holder`` (a step saved with the same arrays):
    each rank file keeps only its header's blocks. Returns the new manifest."""
    step_dir, holder_dir = root / job / str(step), root / job / str(holder)
    m = Manifest.from_json((step_dir / MANIFEST).read_text())
    ranks = []
    for r in m.ranks:
        image = (step_dir / r.file).read_bytes()
        held = (holder_dir / r.file).read_bytes()
        rows = m.shards.of_rank(r.rank)
        first = min(o for o, n in zip(rows.offset.tolist(), rows.length.tolist(), strict=True) if n)
        assert first % ALIGN == 0, "shards start on a block: the header run ends there"
        assert image[first:] == held[first:], "the holder must hold the same shard bytes"
        rest = len(image) - first
        ref = Ref(first, rest, holder, first, checksum.value(image[first:]))
        (step_dir / r.file).write_bytes(image[:first])
        ranks.append(
            dataclasses.replace(
                r,
                size=first,
                crc32c=checksum.value(image[:first]),
                runs=[[0, first]],
                refs=[ref.as_list()],
                image_size=len(image),
                image_crc32c=r.crc32c,
            )
        )
    new = dataclasses.replace(m, ranks=ranks, increment=1)
    (step_dir / MANIFEST).write_text(new.to_json())
    assert Manifest.from_json(new.to_json()).holders() == {holder}
    return new
