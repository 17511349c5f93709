"""Copying a save's arrays into its shared-memory lease, spread over threads."""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ckptd.core.format import TensorEntry

_COPY_CHUNK = 16 * 2**20
"""Bytes per parallel copy task."""


def copy_into(
    mm: mmap.mmap,
    entries: list[TensorEntry],
    arrays: dict[str, Any],
    copier: ThreadPoolExecutor | None,
) -> None:
    """Copy every array into its place in the lease, spread over threads: large
    arrays in chunks of about _COPY_CHUNK bytes, smaller ones in batches of about
    that many bytes (a transformer's state is thousands of arrays under 2 MiB:
    copied one by one on the calling thread they were most of save())."""
    jobs = []
    batch: list[tuple[TensorEntry, Any]] = []
    batched = 0
    for e in entries:
        if not e.length:
            continue
        src = arrays[e.key]
        if copier is None or e.length < 2 * _COPY_CHUNK or src.ndim == 0:
            batch.append((e, src))
            batched += e.length
            if copier is not None and batched >= _COPY_CHUNK:
                jobs.append(copier.submit(_copy_arrays, mm, batch))
                batch, batched = [], 0
            continue
        dst = np.ndarray(e.shape, e.dtype, buffer=mm, offset=e.offset)
        rows = max(1, _COPY_CHUNK * src.shape[0] // e.length)
        for start in range(0, src.shape[0], rows):
            piece = slice(start, start + rows)
            jobs.append(copier.submit(np.copyto, dst[piece], src[piece], casting="no"))
    _copy_arrays(mm, batch)  # the last batch here, beside the others
    for job in jobs:
        job.result()


def _copy_arrays(mm: mmap.mmap, batch: list[tuple[TensorEntry, Any]]) -> None:
    """Copy each array of ``batch`` into its place in ``mm``: runs of arrays of one
    dtype that lie back to back in the lease (the layout packs them so) in one
    ``np.concatenate``, 0.2 us an array instead of ~1 us for a view and a copyto
    each (a transformer's state is thousands of biases and norms of a few KiB)."""
    run: list[tuple[TensorEntry, Any]] = []
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


def _copy_run(mm: mmap.mmap, run: list[tuple[TensorEntry, Any]]) -> None:
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
