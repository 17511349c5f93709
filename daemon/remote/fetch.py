"""Reading checkpoints back from the remote tier: markers, manifests, verified downloads.

Used by restore (bucket -> ``<root>/.cache`` -> committed locally), by fetches of
other nodes' parts, and by ``ckptd pull`` (bucket -> any directory).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from ckptd.core.errors import DataLoss, NotFound
from ckptd.core.manifest import Manifest

from ..io import gather_all, in_thread
from .base import Remote
from .layout import RemoteStep, complete_steps_in, file_key, manifest_key


async def complete_steps(remote: Remote, job: str) -> dict[int, RemoteStep]:
    """Steps of ``job`` with at least one ``_complete`` marker, and the nodes that have one."""
    found = complete_steps_in(await remote.list_keys(job + "/"))
    return {step: info for (j, step), info in found.items() if j == job}


async def node_manifest(
    remote: Remote,
    job: str,
    step: int,
    nodes: set[str],
    rank: int | None,
    prefer: str,
    adopted: bool = False,
) -> tuple[str, bytes, Manifest]:
    """The manifest (raw bytes, parsed) of the node whose part of ``step`` holds ``rank``."""
    for node in sorted(nodes, key=lambda n: (n != prefer, n)):
        raw = await remote.get_bytes(manifest_key(job, step, node, adopted))
        manifest = Manifest.from_json(raw.decode())
        if rank is None or rank in {r.rank for r in manifest.ranks}:
            return node, raw, manifest
    raise NotFound(f"no node's copy of step {step} of job {job!r} in the bucket holds rank {rank}")


async def download_files(
    remote: Remote,
    job: str,
    step: int,
    node: str,
    manifest: Manifest,
    dest: Path,
    progress: Callable[[int], None] | None = None,
    memory_for: Callable[[str], Awaitable[memoryview | None]] | None = None,
) -> None:
    """Download one node's files of a step into ``dest`` with parallel ranged reads.

    Each file's crc32c must match the manifest (a corrupt bucket copy is never
    installed); files are fsynced. The caller writes the manifest last (its commit).
    ``memory_for(name)`` may give page-aligned memory (a restore lease) where that file is also left
    whole, so it need not be read back from disk; each file's download starts as
    soon as its memory is ready.
    """

    async def one(name: str, size: int, want: int) -> None:
        memory = await memory_for(name) if memory_for is not None else None
        key = file_key(job, step, node, name, manifest.adopted)
        if "/" in name:  # an adopted tree's sub-directories
            await in_thread(lambda: (dest / name).parent.mkdir(parents=True, exist_ok=True))
        got = await remote.download(key, dest / name, size, memory)
        if got != want:
            raise DataLoss(
                f"the bucket's copy of {key} has crc32c {got:#010x}, "
                f"expected {want:#010x}: it is corrupt"
            )
        if progress is not None:
            progress(size)

    # One failed file cancels the others and waits for them: the caller gives their
    # memory back only when nothing writes into it any more.
    await gather_all(*(one(r.file, r.size, r.crc32c) for r in manifest.ranks))
