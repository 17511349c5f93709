"""Copying a save's arrays into its shared-memory lease, spread over threads."""

from __future__ import annotations

import contextlib
import mmap
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ckptd.core.format import TensorEntry

_COPY_CHUNK = 16 * 2**20
"""Bytes per parallel copy task."""
_BYTE_COPY = 64 * 2**10
"""Arrays up to this size are copied as bytes (the copy holds the GIL; numpy's does not)."""


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
    """Copy each array of ``batch`` into its place in ``mm``."""
    for e, src in batch:
        if e.length <= _BYTE_COPY and src.flags.c_contiguous and src.dtype == e.dtype:
            # Bytes into bytes: a slice assignment costs a third of an ndarray + copyto.
            # Dtypes the buffer protocol cannot name (bfloat16) take the numpy path.
            with contextlib.suppress(ValueError, TypeError):
                mm[e.offset : e.offset + e.length] = src.data.cast("B")
                continue
        np.copyto(np.ndarray(e.shape, e.dtype, buffer=mm, offset=e.offset), src, casting="no")
