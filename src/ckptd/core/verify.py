"""Re-reading a committed step's files against every crc32c its manifest records
(``ckptd verify``, a restore's or an upload's check of the local copy).

A full rank file is checked shard by shard in one pass, and whole (its header and
padding too). An incremental one (core/increments.py) holds only its runs: its
own shards are checked at their place in the file (the shard table's offsets are
the image's), and each shard it references in the file of the older step holding
it, which must be committed in the same tier.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

# Modules, not names: increments and manifest import checksum, which imports this.
from . import increments
from . import manifest as manifest_module
from .checksum import combine_all, of_file, of_file_ranges

if TYPE_CHECKING:
    from .manifest import Manifest
    from .shard_table import ShardTable


def verify_step(
    directory: Path,
    manifest: Manifest,
    progress: Callable[[int], None] | None = None,
    unreadable: list[str] | None = None,
    holder_dir: Callable[[int], Path] | None = None,
    references: bool = True,
) -> list[str]:
    """Re-read a committed step's files and compare every crc32c the manifest records;
    returns what does not match (empty if intact). Adopted trees: each whole file;
    ckptd's rank files: each shard. ``progress(n)``: after each chunk of ``n`` bytes.
    ``unreadable``: if given, files this process may not read go there (with why)
    instead of among the mismatches: a check run as the wrong user is no corruption.

    An incremental rank file (core/increments.py): its own shards at their place in
    the file, and (``references``) each shard it references, read from the file of
    the older step holding it, in ``holder_dir(step)`` (default: beside
    ``directory``); a holder not committed there is a mismatch like any other."""
    bad: list[str] = []
    if manifest.adopted:
        for r in manifest.ranks:
            try:
                if of_file(directory / r.file, progress=progress) != r.crc32c:
                    bad.append(r.file)
            except PermissionError as exc:
                (bad if unreadable is None else unreadable).append(f"{r.file}: {exc.strerror}")
            except (OSError, ValueError) as exc:
                bad.append(f"{r.file}: {exc}")
        return bad
    for r in manifest.ranks:
        t = manifest.shards.of_rank(r.rank)
        shards = list(
            zip(t.keys, t.offset.tolist(), t.length.tolist(), t.crc32c.tolist(), strict=True)
        )
        if r.runs is not None:
            shards = _own_shards(r.runs, r.refs, shards)
        bad += _verify_rank_file(directory / r.file, r.size, r.crc32c, shards, progress, unreadable)
        if r.runs is not None and references:
            where = holder_dir or (lambda step: directory.parent / str(step))
            bad += verify_references(r.file, r.refs, t, where, progress, unreadable)
    return bad


def _own_shards(
    runs: list[list[int]], refs: list[list[int]] | None, shards: list[tuple[str, int, int, int]]
) -> list[tuple[str, int, int, int]]:
    """An incremental file's own shards (in none of its references), each at its
    offset in the file (the table's offsets are the image's)."""
    held = increments.refs_of(refs)
    starts = [ref.start for ref in held]
    own = []
    for key, offset, length, crc in shards:
        i = bisect.bisect_right(starts, offset) - 1
        if length and i >= 0 and offset + length <= held[i].start + held[i].length:
            continue  # a reference's: checked in its holder's file
        try:
            own.append((key, increments.file_offset(runs, offset, length), length, crc))
        except ValueError:  # the manifest's check keeps this out; never skip a shard
            own.append((key, -1, length, crc))
    return own


def verify_references(
    file: str,
    refs: list[list[int]] | None,
    table: ShardTable,
    holder_dir: Callable[[int], Path],
    progress: Callable[[int], None] | None = None,
    unreadable: list[str] | None = None,
) -> list[str]:
    """The shards an incremental rank file references, each read from ``file`` of the
    older step holding it (in ``holder_dir(step)``, committed: its manifest there)
    and compared with its crc32c, and each referenced range's whole crc32c (the
    padding between its shards); returns what does not match."""
    bad: list[str] = []
    keys, offs, lens = table.keys, table.offset.tolist(), table.length.tolist()
    crcs = table.crc32c.tolist()
    order = sorted(range(len(keys)), key=offs.__getitem__)
    missing: dict[int, list[str]] = {}  # a holder not committed: the shards it holds
    for ref in increments.refs_of(refs):
        inside = [i for i in order if lens[i] and ref.start <= offs[i] < ref.start + ref.length]
        where = holder_dir(ref.step)
        if ref.step in missing or not (where / manifest_module.MANIFEST).is_file():
            missing.setdefault(ref.step, []).extend(keys[i] for i in inside)
            continue
        shards = [(keys[i], ref.offset + offs[i] - ref.start, lens[i], crcs[i]) for i in inside]
        found = _verify_range(
            where / file, ref.offset, ref.length, ref.crc32c, shards, progress, unreadable
        )
        bad += [f"{b} (step {ref.step}, referenced)" for b in found]
    for step, held in missing.items():
        first = f", {held[0]}..." if held else ""
        bad.append(
            f"{file}: step {step}, holding {len(held)} of its shards{first}, is not committed here"
        )
    return bad


def _verify_rank_file(
    path: Path,
    size: int,
    file_crc: int,
    shards: list[tuple[str, int, int, int]],
    progress: Callable[[int], None] | None,
    unreadable: list[str] | None,
) -> list[str]:
    """One pass over a rank file: each shard's crc32c, and the whole file's (which
    also covers the header and the padding between shards)."""
    return _verify_range(path, 0, size, file_crc, shards, progress, unreadable, whole=True)


def _verify_range(
    path: Path,
    start: int,
    size: int,
    range_crc: int,
    shards: list[tuple[str, int, int, int]],
    progress: Callable[[int], None] | None,
    unreadable: list[str] | None,
    whole: bool = False,
) -> list[str]:
    """One pass over ``size`` bytes of a file from ``start`` (``whole``: the file,
    which must be that long): each shard's crc32c (``(key, offset in the file,
    length, crc32c)``; a negative offset: not in the file) and the range's."""
    missing = [f"{path.name}:{key}: not in the file" for key, o, _, _ in shards if o < 0]
    pieces: list[tuple[int, int, int | None]] = []  # offset, length, index into shards
    at = start
    placed = [(i, s) for i, s in enumerate(shards) if s[1] >= 0]
    for i, (_, offset, length, _) in sorted(placed, key=lambda x: x[1][1]):
        if offset > at:
            pieces.append((at, offset - at, None))
        pieces.append((offset, length, i))
        at = max(at, offset + length)
    if start + size > at:
        pieces.append((at, start + size - at, None))
    try:
        actual = path.stat().st_size
        if actual != size if whole else actual < start + size:
            if whole:
                return [f"{path.name}: {actual} bytes, {size} recorded at commit"]
            return [f"{path.name}: {actual} bytes, too short for [{start}, {start + size})"]
        crcs = of_file_ranges(path, [(o, n) for o, n, _ in pieces], progress=progress)
    except PermissionError as exc:
        if unreadable is None:
            return [f"{path.name}: {exc}"]
        unreadable.append(f"{path.name}: {exc.strerror}")
        return []
    except (OSError, ValueError) as exc:
        return [f"{path.name}: {exc}"]
    bad = missing + [
        f"{path.name}:{shards[i][0]}"
        for (_, _, i), c in zip(pieces, crcs, strict=True)
        if i is not None and c != shards[i][3]
    ]
    total = combine_all([(c, n) for c, (_, n, _) in zip(crcs, pieces, strict=True)])
    if not bad and total != range_crc:
        what = "header or padding" if whole else f"padding in [{start}, {start + size})"
        bad.append(f"{path.name}: {what} differs from the commit")
    return bad
