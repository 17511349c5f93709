"""Taking this node's copy of a step out of the bucket: the publish protocol in reverse.

Every removal runs inside ``NodeIndex.removing`` (a fetch that starts meanwhile is
refused). The index entry is flagged ``retracting`` first: from then on this node's
daemons neither list nor fetch the copy (remote/index.py). Then the
``_complete/<node>`` marker: from then on no node lists or restores it. Then the
entry, then the objects. A crash or a failed request anywhere after the flag leaves
the flagged entry, and the drain finishes the removal between its uploads
(lifecycle/replaced.py: no upload under the number runs then, and the keys name the
number, not the timeline); a crash after the entry leaves objects no entry names,
which cost space and mislead no reader. Retention evicts through it, and so does the
upload of a save that replaces a step of an earlier timeline (publish.py).
"""

from __future__ import annotations

import asyncio

from ckptd.core.manifest import DATA_SPREAD, DATA_TIMELINE

from .. import faults
from .base import Remote
from .index import Entry, NodeIndex, marker_entry
from .layout import data_prefix, marker_key, record_prefix, step_prefix


async def retract_marker(
    remote: Remote, index: NodeIndex, job: str, step: int, node: str, adopted: bool
) -> None:
    """Flag the step's entry, then delete ``node``'s marker of it: its copy is no
    longer complete anywhere."""
    await index.flag_retracting(job, step)
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


async def finish(remote: Remote, index: NodeIndex, job: str, entry: Entry, node: str) -> None:
    """Finish taking out a copy whose entry is flagged (a removal cut short): the
    marker (if still its own), the entry, the objects; the rank files of a held copy
    stay (held.py records it before its removal begins). A marker of another timeline
    under the number is a later save's, uploaded before the index could say so: only
    the entry goes, and the rank files of its own timeline's layout."""
    with index.removing(job, entry.step):
        try:
            raw = await remote.get_bytes(marker_key(job, entry.step, node, entry.adopted))
        except FileNotFoundError:
            raw = None
        if raw is not None and marker_entry(entry.step, entry.adopted, raw).timeline != (
            entry.timeline
        ):
            await index.remove(job, entry.step)
            if not entry.adopted and entry.data_layout == DATA_TIMELINE:
                prefix = data_prefix(job, entry.step, node, DATA_TIMELINE, entry.timeline)
                await remote.delete(await remote.list_keys(f"{prefix}/"))
            return
        keep = (entry.step, entry.timeline) in await index.held(job)
        await retract_marker(remote, index, job, entry.step, node, entry.adopted)
        await delete_copy(remote, index, job, entry.step, node, entry.adopted, keep_data=keep)
