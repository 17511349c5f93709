"""Held copies in the bucket: a replaced step's files, kept while this node's steps read them.

The bucket side of local/held.py. A save that replaces a step of an earlier
timeline takes that step's copy out of the bucket before its own goes up
(publish.py), marker first. When this node's steps (in the bucket, or on the disk
waiting to go up) read that copy's rank files, its files stay where they are
(the layout puts each timeline's files under their own prefix, so the new save
never overwrites them) and the copy becomes *held*:

    <job>/_held/<node>/<step>.<timeline>.json   its manifest (how to read its files)
    <job>/_index/<node>.json  "held"            this node's held copies (index.py)

Nothing lists or restores a held copy by number: a restore of a step reading it
brings it into the local tier's held copies (source.py), ``ckptd pull`` and
``ckptd verify`` read it there. The order makes a crash harmless: the manifest
and the index's record first, then the marker, the records and the entry; the
deletion of a copy no step reads any more (:func:`prune`) removes its files,
then its manifest, then its record.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Set
from pathlib import Path

from ckptd.core.manifest import MANIFEST, Manifest
from ckptd.core.names import check_name
from ckptd.core.timeline import timeline_at

from ..files import read_small
from .base import Remote
from .index import Entry, NodeIndex
from .layout import data_prefix, file_key, manifest_key
from .read import parse_remote_manifest
from .retract import delete_copy, retract_marker

log = logging.getLogger("ckptd.remote")

HELD_DIR = "_held"


def held_key(job: str, node: str, step: int, timeline: int) -> str:
    """Where the manifest of ``node``'s held copy of ``step`` of ``timeline`` lives."""
    return f"{job}/{HELD_DIR}/{check_name('node', node)}/{step}.{timeline}.json"


async def hold(remote: Remote, index: NodeIndex, job: str, node: str, step: int) -> None:
    """Take this node's copy of ``step`` out of view, its files held (the module
    docstring's order)."""
    raw = await remote.get_bytes(manifest_key(job, step, node))
    manifest = parse_remote_manifest(raw, manifest_key(job, step, node), job, step, node, False)
    await remote.put_bytes(held_key(job, node, step, manifest.timeline), raw)
    await index.add_held(job, step, manifest.timeline, manifest.data_layout)
    with index.removing(job, step):
        await retract_marker(remote, index, job, step, node, False)
        await delete_copy(remote, index, job, step, node, False, keep_data=True)


async def take_out(
    remote: Remote, index: NodeIndex, job: str, node: str, old: Entry, read: Set[tuple[int, int]]
) -> None:
    """Take this node's copy ``old`` (a replaced save's) out of view, marker first: its
    files held while steps of this node read them (``read``: ``(step, timeline)``),
    deleted otherwise."""
    if not old.adopted and (old.step, old.timeline) in read:
        await hold(remote, index, job, node, old.step)
        return
    with index.removing(job, old.step):
        await retract_marker(remote, index, job, old.step, node, old.adopted)
        await delete_copy(remote, index, job, old.step, node, old.adopted)


async def held_manifest(
    remote: Remote, job: str, node: str, step: int, timeline: int
) -> tuple[bytes, Manifest]:
    """A held copy's manifest (raw, parsed and checked); FileNotFoundError if none."""
    key = held_key(job, node, step, timeline)
    raw = await remote.get_bytes(key)
    manifest = parse_remote_manifest(raw, key, job, step, node, False)
    if manifest.timeline != timeline:
        raise FileNotFoundError(f"{key} holds a copy of timeline {manifest.timeline}")
    return raw, manifest


async def publish(
    remote: Remote, index: NodeIndex, job: str, node: str, step: int, timeline: int, where: Path
) -> None:
    """Upload the local held copy at ``where`` (a replaced step's files that a step
    going up reads): its files, checked against its manifest's crc32c, then its
    manifest, then its record in the index."""
    raw = await asyncio.to_thread(read_small, where / MANIFEST)
    manifest = Manifest.from_json(raw.decode())
    await asyncio.gather(
        *(
            remote.put_file(
                where / r.file,
                file_key(job, step, node, r.file, False, manifest.data_layout, timeline),
                r.size,
                r.crc32c,
            )
            for r in manifest.ranks
        )
    )
    await remote.put_bytes(held_key(job, node, step, timeline), raw)
    await index.add_held(job, step, timeline, manifest.data_layout)
    log.info("%s/%d (timeline %d): held copy uploaded to %s", job, step, timeline, remote.url)


def read_in_bucket(entries: Mapping[int, Entry]) -> set[tuple[int, int]]:
    """``(step, timeline)`` of every holder the node's steps in the bucket read."""
    return {(n, timeline_at(n, e.timeline, e.forks)) for e in entries.values() for n in e.holders}


async def prune(
    remote: Remote, index: NodeIndex, job: str, node: str, local: Set[tuple[int, int]]
) -> None:
    """Delete this node's held copies of ``job`` that no step reads: none of the node's
    steps in the bucket, nor (``local``) of its steps on the disk on their way there."""
    copies = await index.held(job)
    if not copies:
        return
    read = read_in_bucket(await index.entries(job)) | local
    for (step, timeline), layout in sorted(copies.items()):
        if (step, timeline) in read:
            continue
        prefix = data_prefix(job, step, node, layout, timeline)
        await remote.delete(await remote.list_keys(f"{prefix}/"))
        await remote.delete([held_key(job, node, step, timeline)])
        await index.remove_held(job, step, timeline)
        log.info("%s/%d (timeline %d): held copy deleted from the bucket", job, step, timeline)
