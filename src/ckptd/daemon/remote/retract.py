"""Taking this node's copy of a step out of the bucket: the publish protocol in reverse.

The ``_complete/<node>`` marker goes first: from then on no node lists or
restores the copy. Then its entry in the node's index, then its objects: a crash
between the marker and the entry leaves an entry whose copy is still whole (the
next pass, the evictor's or the next upload of a save under the same number,
takes it out again); a crash after the entry leaves objects no entry names, which
cost space and mislead no reader (the entry going last listed, after a restart, a
step whose copy was half deleted). Retention evicts through it, and so does the
upload of a save that replaces a step of an earlier timeline (publish.py).
"""

from __future__ import annotations

import asyncio

from ckptd.core.manifest import DATA_SPREAD, DATA_TIMELINE

from .. import faults
from .base import Remote
from .index import NodeIndex
from .layout import data_prefix, marker_key, record_prefix, step_prefix


async def retract_marker(remote: Remote, job: str, step: int, node: str, adopted: bool) -> None:
    """Delete ``node``'s marker of the step: its copy is no longer complete anywhere."""
    await remote.delete([marker_key(job, step, node, adopted)])
    await asyncio.to_thread(faults.hit, "evict.remote_marker_gone")


async def delete_copy(
    remote: Remote,
    index: NodeIndex,
    job: str,
    step: int,
    node: str,
    adopted: bool,
    keep_data: bool = False,
) -> None:
    """After :func:`retract_marker`: the copy's index entry, then its objects.
    ``keep_data``: its rank files stay, held for the steps that read them (held.py).
    The entry goes first: a daemon killed between the two must not find an entry
    whose copy is half deleted (it would list a step that cannot be read); one killed
    after leaves objects no entry names, which cost space and mislead no reader."""
    tree, records = step_prefix(job, step), record_prefix(job, step, adopted)
    prefixes = [f"{records}/{node}/"]
    if adopted:  # out of the framework's view first, then deleted
        await remote.retract_tree(tree, records, node)
        prefixes.append(f"{tree}/")
    elif not keep_data:  # rank files of the spread layouts (of the old one: the records')
        entry = (await index.entries(job)).get(step)
        if entry is not None and entry.data_layout == DATA_TIMELINE:
            prefixes.append(f"{data_prefix(job, step, node, DATA_TIMELINE, entry.timeline)}/")
        elif not any(
            n == step and layout != DATA_TIMELINE
            for (n, _), layout in (await index.held(job)).items()
        ):
            # Not the files of another timeline's copy held under the same number.
            prefixes.append(f"{data_prefix(job, step, node, DATA_SPREAD)}/")
    await index.remove(job, step)
    for prefix in prefixes:
        await remote.delete(await remote.list_keys(prefix))
