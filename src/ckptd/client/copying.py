"""Copying a save's arrays into its shared-memory lease, spread over threads."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ckptd.core.errors import SaveFailed
from ckptd.core.format import TensorEntry

from .leaves.device import jax_on_cpu

HOST_BATCH_BYTES = 64 * 2**20
"""jax shards are copied to host and into the lease this many bytes at a time."""
MIN_PART = 4 * 2**20
"""The smallest part a thread takes: a save under twice this stays on the calling
thread (a task for a few arrays of KiB costs more than their copy)."""

Piece = tuple[TensorEntry, Any]
"""An array (or a slice of one) and the place in the lease it is copied to."""


def copy_into(
    mm: mmap.mmap,
    entries: list[TensorEntry],
    arrays: dict[str, Any],
    copier: ThreadPoolExecutor | None,
    threads: int = 1,
) -> None:
    """Copy every array into its place in the lease on ``threads`` threads: the
    calling one and ``threads - 1`` of ``copier``.

    The bytes are cut into parts (an array that straddles two is cut between them)
    that each thread takes in turn until none is left: the first a ``2 * threads``-th
    of the bytes, each next one that share of what is left, down to MIN_PART, so a
    thread the machine holds back leaves the others little to wait for at the end
    (on a 2-core machine other processes use, a copy split in equal halves waited
    for the later half). Tasks of a fixed size (16 MiB chunks of large arrays and
    batches of small ones) left the calling thread idle, paid a task per chunk, and
    on a transformer's state (1,500 arrays, most under 2 MiB) made the copy ~6%
    slower than a memcpy of the same arrays split in two by bytes
    (bench/bench_save_floor.py)."""
    live = [e for e in entries if e.length]
    total = sum(e.length for e in live)
    workers = max(1, min(threads if copier is not None else 1, total // MIN_PART))
    if workers == 1:
        _copy_arrays(mm, [(e, arrays[e.key]) for e in live])
        return
    assert copier is not None
    parts = iter(split_by_bytes(live, arrays, guided_ends(total, workers)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                part = next(parts, None)
            if part is None:
                return
            _copy_arrays(mm, part)

    jobs = [copier.submit(work) for _ in range(workers - 1)]
    try:
        work()
    finally:
        for job in jobs:
            job.exception()  # every copy ends before the lease may be given back
    for job in jobs:
        job.result()


def host_batches(
    entries: list[TensorEntry], device: dict[str, Any], what: str
) -> Iterator[tuple[list[TensorEntry], dict[str, np.ndarray]]]:
    """The host arrays of jax shards (``device``: each entry's ShardPlan), in batches
    of about :data:`HOST_BATCH_BYTES`: one copy call for many small arrays (a LoRA
    adapter's are KiBs), and no more than a batch of host copies alive at once (on an
    accelerator ``np.asarray`` is a copy of its own). ``what``: the save, for errors."""
    batch: list[TensorEntry] = []
    hosts: dict[str, np.ndarray] = {}
    held = 0
    for e in entries:
        try:
            hosts[e.key] = np.asarray(device[e.key].data)
        except RuntimeError as exc:
            if "deleted" not in str(exc):
                raise
            # jax deletes a donated array's buffer whatever refers to it.
            raise SaveFailed(
                f"{what}: {e.key!r} was deleted before ckptd copied it to host "
                "(donated to a jitted step: donate_argnums/donate_argnames). Call "
                "handle.wait_copied() before the step that donates the saved "
                "state, or use ckptd.client.orbax.CheckpointManager, whose save() "
                "returns once the arrays may be donated"
            ) from None
        batch.append(e)
        held += e.length
        if held >= HOST_BATCH_BYTES:
            yield batch, hosts
            batch, hosts, held = [], {}, 0
    if batch:
        yield batch, hosts


def cpu_views(
    entries: list[TensorEntry], device: dict[str, Any], what: str
) -> tuple[list[TensorEntry], dict[str, np.ndarray], list[TensorEntry]]:
    """The entries of jax shards (``device``: each entry's ShardPlan) on a CPU device,
    their numpy views (of the shards' memory: no copy) by key (:func:`host_batches`'s
    errors), and the other entries."""
    cpu = [e for e in entries if jax_on_cpu(device[e.key].data)]
    if not cpu:
        return cpu, {}, entries
    views: dict[str, np.ndarray] = {}
    for _, hosts in host_batches(cpu, device, what):
        views.update(hosts)
    return cpu, views, [e for e in entries if e.key not in views]


def guided_ends(total: int, threads: int) -> list[int]:
    """Where each part of ``total`` bytes ends when ``threads`` share them: each part
    a ``2 * threads``-th of the bytes not yet given out, at least MIN_PART."""
    ends, at = [], 0
    while at < total:
        at = min(total, at + max((total - at) // (2 * threads), MIN_PART))
        ends.append(at)
    return ends


def split_by_bytes(
    entries: list[TensorEntry], arrays: dict[str, Any], ends: list[int]
) -> list[list[Piece]]:
    """``entries`` (in lease order) cut into parts, part ``k`` ending as near ``ends[k]``
    bytes into their concatenation as its arrays allow (``ends`` ascending, the last
    the total).

    An array that crosses an end is cut there: a C-contiguous one at any element
    (as a flat view), any other along its first axis (whole rows); one that cannot
    be cut (a scalar, a single strided row) goes whole to one part."""
    parts = len(ends)
    out: list[list[Piece]] = [[] for _ in range(parts)]
    k, pos = 0, 0  # the part being filled; bytes given to parts so far
    for e in entries:
        if not e.length:
            continue
        src = arrays[e.key]
        start = 0  # bytes of this array given to parts so far
        while k < parts - 1 and pos + e.length - start > ends[k]:
            cut = _cut(e, src, start, start + ends[k] - pos)
            if cut > start:
                out[k].append(_piece(e, src, start, cut))
                pos, start = pos + cut - start, cut
            if start == e.length:
                break  # an uncuttable array went whole to part k: the next starts there
            k += 1
        if start < e.length:
            out[k].append(_piece(e, src, start, e.length))
            pos += e.length - start
    return out


def _unit(e: TensorEntry, src: Any) -> int:
    """The bytes between two places ``src`` can be cut at."""
    if src.flags.c_contiguous:
        return int(e.dtype.itemsize) or e.length
    if src.ndim and src.shape[0] > 1:
        return e.length // int(src.shape[0])
    return e.length


def _cut(e: TensorEntry, src: Any, start: int, target: int) -> int:
    """The place nearest ``target`` bytes into ``src`` it can be cut at, in [start, length]."""
    unit = _unit(e, src)
    cut = (max(target, 0) + unit // 2) // unit * unit
    return min(max(cut, start), e.length)


def _piece(e: TensorEntry, src: Any, start: int, end: int) -> Piece:
    """Bytes ``[start, end)`` of ``src`` and their place in the lease."""
    if start == 0 and end == e.length:
        return e, src
    if src.flags.c_contiguous:
        item = e.dtype.itemsize
        part = src.reshape(-1)[start // item : end // item]
        return TensorEntry(e.key, e.dtype, part.shape, e.offset + start, end - start), part
    row = e.length // src.shape[0]
    part = src[start // row : end // row]
    return TensorEntry(e.key, e.dtype, part.shape, e.offset + start, end - start), part


def _copy_arrays(mm: mmap.mmap, batch: list[Piece]) -> None:
    """Copy each array of ``batch`` into its place in ``mm``: runs of arrays of one
    dtype that lie back to back in the lease (the layout packs them so) in one
    ``np.concatenate``, 0.2 us an array instead of ~1 us for a view and a copyto
    each (a transformer's state is thousands of biases and norms of a few KiB)."""
    run: list[Piece] = []
    for e, src in batch:
        if not (src.flags.c_contiguous and src.dtype == e.dtype):
            _copy_run(mm, run)
            run = []
            np.copyto(np.ndarray(e.shape, e.dtype, buffer=mm, offset=e.offset), src, casting="no")
            continue
        if run:
            last = run[-1][0]
            if last.dtype != e.dtype or last.offset + last.length != e.offset:
                _copy_run(mm, run)
                run = []
        run.append((e, src))
    _copy_run(mm, run)


def _copy_run(mm: mmap.mmap, run: list[Piece]) -> None:
    """Copy C-contiguous arrays of one dtype into back-to-back places in ``mm``."""
    if not run:
        return
    first = run[0][0]
    if len(run) == 1:
        np.copyto(np.ndarray(first.shape, first.dtype, buffer=mm, offset=first.offset), run[0][1])
        return
    count = sum(e.length for e, _ in run) // first.dtype.itemsize
    dst = np.ndarray((count,), first.dtype, buffer=mm, offset=first.offset)
    np.concatenate([src for _, src in run], axis=None, out=dst)
