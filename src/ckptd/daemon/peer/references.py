"""Which older steps a peer restore of an incremental step must bring too.

An incremental step's rank files (core/increments.py) hold only what changed; the
rest is read from older steps' files of the same node, each of which may reference
older ones in turn. The local tier holds a step only with all of them, so a node
taking a step back from its peers takes those it lacks as well, from the same
node's replicas (a peer holds a replica with every step it references:
replicas.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ckptd.core.errors import DataLoss
from ckptd.core.manifest import Manifest
from ckptd.core.names import UNKNOWN_OWNER, Owner

from ..catalog import Step
from .link import Peer


@dataclass(frozen=True)
class Replica:
    """One replica of a step as the peers list it: its manifest, parsed once, and
    the peers holding that very text."""

    manifest: Manifest
    text: str
    """The manifest as the peers gave it: the commit writes it as it came."""
    peers: list[Peer]
    owner: Owner = UNKNOWN_OWNER
    """The job's owner on this node, as the first peer naming it says this node said
    when it sent it (core/names.py)."""


def referenced(
    manifest: Manifest,
    local: Callable[[int], Step | None],
    listed: dict[tuple[str, int], list[Replica]],
) -> dict[int, Replica | None]:
    """Every step ``manifest`` references, transitively: the replica to take it from
    (of ``listed``, the peers' replicas of its node), or None where the local tier
    (``local(step)``) holds it already. DataLoss if one is in neither, or its local
    copy lacks a file referenced: the restore then goes on to the bucket."""
    job, node = manifest.job, manifest.node
    wanted: dict[int, Replica | None] = {}
    todo = set(manifest.holders())
    while todo:
        step = todo.pop()
        if step in wanted:
            continue
        st = local(step)
        if st is not None and st.local and st.manifest is not None:
            if not _same_files(st.manifest, manifest):
                raise DataLoss(
                    f"{job}/{manifest.step} references step {step}, whose local copy "
                    "holds other files"
                )
            wanted[step] = None
            todo |= st.manifest.holders()
            continue
        found = [r for r in listed.get((job, step), []) if r.manifest.node == node]
        if not found:
            raise DataLoss(f"{job}/{manifest.step} references step {step}, which no peer holds")
        if st is not None and st.timeline > found[0].manifest.timeline:
            raise DataLoss(
                f"{job}/{manifest.step} references step {step} of timeline "
                f"{found[0].manifest.timeline}, which a later save replaced"
            )
        wanted[step] = found[0]
        todo |= found[0].manifest.holders()
    return wanted


def _same_files(older: Manifest, newer: Manifest) -> bool:
    """Whether ``older`` (a local step) has every rank file of ``newer`` (the step
    referencing it) that references: a reference reads the file of the same name."""
    have = {r.file for r in older.ranks}
    return all(r.file in have for r in newer.ranks if r.refs)
