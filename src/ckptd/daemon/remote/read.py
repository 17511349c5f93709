"""Reading checkpoints back from the remote tier: markers, manifests, verified downloads.

Used by the bucket source for restores (source.py: bucket -> ``<root>/.cache`` ->
committed locally, and other nodes' parts), and by ``ckptd pull`` (bucket -> any
directory).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from ckptd.core.errors import DataLoss, InvalidArgument, NotFound
from ckptd.core.manifest import Manifest, ManifestInvalid
from ckptd.core.names import MAX_PATH_BYTES, check_name
from ckptd.core.timeline import abandoned, merge

from ..catalog.roles import Copies
from ..files import open_dir_beneath
from ..io import gather_all, in_thread
from .base import Remote
from .index import bucket_lineage, marker_entry
from .layout import (
    RemoteStep,
    complete_steps_in,
    file_key,
    manifest_key,
    marker_key,
    parse_marker,
    parse_ranks_key,
    parse_step_name,
    record_prefix,
)
from .ranged import Populate
from .records import MAX_METRIC_NAME, MAX_METRICS

INLINE_MANIFEST_BYTES = 64 * 2**10
"""Larger manifests (~300 shards and more) are parsed on a thread."""


async def complete_steps(remote: Remote, job: str) -> dict[int, RemoteStep]:
    """Steps of ``job`` with at least one ``_complete`` marker, and the nodes that have
    one: a listing of every object of the job (``ckptd ls`` and ``pull``; the daemon
    reads its node's index instead, and :func:`newest_steps` for other nodes')."""
    found = complete_steps_in(await remote.list_keys(job + "/"))
    return {step: info for (j, step), info in found.items() if j == job}


async def step_nodes(remote: Remote, job: str, step: int, adopted: bool) -> set[str]:
    """The nodes whose marker of ``step`` is in the bucket (one listing of its markers:
    a request per 1,000 nodes)."""
    keys = await remote.list_keys(f"{record_prefix(job, step, adopted)}/_complete/")
    return {m.node for m in map(parse_marker, keys) if m is not None and m.step == step}


async def _as_marked(
    remote: Remote, job: str, step: int, adopted: bool, nodes: set[str], node: str
) -> RemoteStep:
    """``step``'s copies on ``nodes``, with the timeline, lineage and time ``node``'s
    marker records (FileNotFoundError: that marker went meanwhile)."""
    raw = await remote.get_bytes(marker_key(job, step, node, adopted))
    entry = marker_entry(step, adopted, raw)
    return RemoteStep(nodes, adopted, entry.timeline, entry.forks, entry.created_unix)


async def step_found(remote: Remote, job: str, step: int, me: str) -> RemoteStep | None:
    """``step`` as its markers say (None: none): the nodes, and the timeline one marker
    records (this node's where it has one). A step a restore asks for by number that
    nothing here knew: its copy may be of a save a later one replaced, which only the
    marker's timeline tells."""
    for adopted in (False, True):
        nodes = await step_nodes(remote, job, step, adopted)
        if not nodes:
            continue
        try:
            node = me if me in nodes else min(nodes)
            return await _as_marked(remote, job, step, adopted, nodes, node)
        except FileNotFoundError:
            return None  # removed meanwhile: being taken out
    return None


def tell(catalog: Copies, job: str, step: int, found: RemoteStep) -> None:
    """Tell ``catalog`` of ``step``'s copies in the bucket as ``found`` (a copy of a
    replaced save is recorded as not a step: Catalog.discovered)."""
    catalog.discovered(
        job,
        step,
        found.nodes,
        found.adopted,
        timeline=found.timeline,
        forks=found.forks,
        created_unix=found.created_unix,
    )


async def learn_step(remote: Remote, catalog: Copies, job: str, step: int) -> None:
    """Tell ``catalog`` of ``step``'s copies in the bucket, as :func:`step_found`
    reads them."""
    if found := await step_found(remote, job, step, catalog.node_id):
        tell(catalog, job, step, found)


async def rank_holders(
    remote: Remote, job: str, step: int, rank: int
) -> tuple[list[str], set[str]]:
    """For a node that needs ``rank`` of a (not adopted) step and does not hold it:
    one listing of the step's records (a request per ~330 nodes: each node's
    manifest, marker and ranks record; per ~100 for a step of the old layout, its
    rank files beside them) -> (the complete nodes whose ranks record
    covers ``rank``, narrowest first; every complete node). A step drained before the
    ranks records names no holder: the caller asks the complete nodes in turn."""
    holders: list[tuple[int, str]] = []
    complete: set[str] = set()
    for key in await remote.list_keys(f"{record_prefix(job, step)}/"):
        if (marker := parse_marker(key)) is not None and marker.step == step:
            complete.add(marker.node)
        elif (ranks := parse_ranks_key(key)) is not None and ranks[1] <= rank <= ranks[2]:
            holders.append((ranks[2] - ranks[1], ranks[0]))
    return [n for _, n in sorted(holders) if n in complete], complete


async def newest_steps(remote: Remote, job: str, count: int) -> dict[int, RemoteStep]:
    """The ``count`` newest live steps of ``job`` that some node completed, with their
    nodes, timelines and lineage: the job's lineage from the nodes' indexes
    (:func:`bucket_lineage`), the step names (one delimited listing), then the
    markers of each, newest first, and one marker's body per step, until ``count``
    steps some node completed are not abandoned (steps a later timeline left behind
    carry higher numbers: core/timeline.py). For a node with no steps of its own in
    the bucket (a replacement under a new name): O(count x nodes / 1,000) requests,
    not a listing of every object of every step."""
    names = [parse_step_name(n) for n in await remote.list_dirs(f"{job}/")]
    found: dict[int, RemoteStep] = {}
    forks = await bucket_lineage(remote, job)
    for step, adopted in sorted(((s, a) for s, a in names if s is not None), reverse=True):
        nodes = await step_nodes(remote, job, step, adopted)
        if not nodes:
            continue
        try:
            info = await _as_marked(remote, job, step, adopted, nodes, min(nodes))
            forks = merge(forks, info.forks)
        except FileNotFoundError:
            info = RemoteStep(nodes, adopted)
        found[step] = info
        live = [n for n, s in found.items() if not abandoned(s.timeline or 0, n, forks)]
        if len(live) >= count:
            break
    return found


async def node_manifest(
    remote: Remote,
    job: str,
    step: int,
    nodes: set[str],
    rank: int | None,
    prefer: str,
    adopted: bool = False,
    timeline: int | None = None,
) -> tuple[str, bytes, Manifest]:
    """The manifest (raw bytes, parsed) of the node whose part of ``step`` holds ``rank``
    (with ``timeline``: a part of that timeline's save only)."""
    for node in sorted(nodes, key=lambda n: (n != prefer, n)):
        key = manifest_key(job, step, check_name("node", node), adopted)
        raw = await remote.get_bytes(key)
        args = (raw, key, job, step, node, adopted)
        # Thousands of shards are parsed and checked per shard: not on the event loop.
        many = len(raw) > INLINE_MANIFEST_BYTES
        manifest = (
            await in_thread(parse_remote_manifest, *args) if many else parse_remote_manifest(*args)
        )
        if timeline is not None and manifest.timeline != timeline:
            continue  # a copy of another save under this number, not yet replaced
        if rank is None or rank in {r.rank for r in manifest.ranks}:
            return node, raw, manifest
    of = f" of timeline {timeline}" if timeline is not None else ""
    raise NotFound(
        f"no node's copy of step {step}{of} of job {job!r} in the bucket holds rank {rank}"
    )


def parse_remote_manifest(
    raw: bytes, key: str, job: str, step: int, node: str, adopted: bool
) -> Manifest:
    """A manifest read from ``key`` in the bucket, checked (:meth:`Manifest.check`) and
    about the step it was read for: one naming another job, step, node or kind, or a
    file outside its step, or carrying more into every listing of the step than a
    save can (metrics, the adopted source), is :class:`ManifestInvalid` (the copy is
    corrupt)."""
    try:
        manifest = Manifest.from_json(raw.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestInvalid(f"the bucket's {key} is not a valid manifest: {exc}") from None
    listed = len(manifest.metrics) <= MAX_METRICS and all(
        0 < len(name) <= MAX_METRIC_NAME for name in manifest.metrics
    )
    if not listed or len(manifest.source.encode(errors="replace")) > MAX_PATH_BYTES:
        raise ManifestInvalid(
            f"the bucket's {key} carries more metrics, longer metric names or a longer "
            "source than any save can"
        )
    said = (manifest.job, manifest.step, manifest.node, manifest.adopted)
    if said != (job, step, node, adopted):
        raise ManifestInvalid(
            f"the bucket's {key} describes job {manifest.job!r} step {manifest.step} "
            f"node {manifest.node!r}{' (adopted)' if manifest.adopted else ''}, "
            "not the step it is filed under"
        )
    return manifest


async def download_files(
    remote: Remote,
    job: str,
    step: int,
    node: str,
    manifest: Manifest,
    dest: Path,
    progress: Callable[[int], None] | None = None,
    memory_for: Callable[[str], Awaitable[tuple[memoryview, Populate | None] | None]] | None = None,
) -> None:
    """Download one node's files of a step into ``dest`` with parallel ranged reads.

    Each file's crc32c must match the manifest (a corrupt bucket copy is never
    installed); files are fsynced. The caller writes the manifest last (its commit).
    ``memory_for(name)`` may give page-aligned memory (a restore lease) where that
    file is also left whole, so it need not be read back from disk, and how to
    allocate its pages as the parts arrive (None: allocated already); each file's
    download starts as soon as its memory is ready. ``progress(n)`` is called on the
    loop as each part of ``n`` bytes is in (each file is checked once whole).
    """

    try:
        # Checked when the manifest was parsed; again here, as no name may ever reach
        # a path unchecked (a manifest could have been built by other code).
        keys = {
            r.file: file_key(
                job, step, node, r.file, manifest.adopted, manifest.data_layout, manifest.timeline
            )
            for r in manifest.ranks
        }
    except InvalidArgument as exc:
        raise ManifestInvalid(f"manifest of {job}/{step} node {node}: {exc}") from None
    # Every file is opened beneath ``dest``'s fd, component by component with
    # O_NOFOLLOW and created O_EXCL: no symlink in the tree can redirect a write.
    # On the loop, not in a thread: a few syscalls, and a cancelled thread would leak fds.
    root_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)

    async def one(name: str, size: int, want: int) -> None:
        memory, populate = (await memory_for(name) if memory_for else None) or (None, None)
        key = keys[name]
        parent, _, base = name.rpartition("/")  # an adopted tree's sub-directories
        dir_fd = open_dir_beneath(root_fd, parent, make=True)
        try:
            got = await remote.download(
                key, base, size, memory, dir_fd=dir_fd, populate=populate, progress=progress
            )
        finally:
            os.close(dir_fd)
        if got != want:
            raise DataLoss(
                f"the bucket's copy of {key} has crc32c {got:#010x}, "
                f"expected {want:#010x}: it is corrupt"
            )

    try:
        # One failed file cancels the others and waits for them: the caller gives their
        # memory back only when nothing writes into it any more.
        await gather_all(*(one(r.file, r.size, r.crc32c) for r in manifest.ranks))
    finally:
        with contextlib.suppress(OSError):
            os.close(root_fd)
