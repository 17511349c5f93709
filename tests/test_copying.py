"""The copy of a save's arrays into its lease: one part per thread, split by bytes,
every byte where the layout puts it (whatever the arrays' strides)."""

from __future__ import annotations

import mmap
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from ckptd.client.copying import MIN_PART, copy_into, split_by_bytes
from ckptd.client.saver import Saver
from ckptd.core.format import TensorEntry, plan_layout


class RecordingCopier(ThreadPoolExecutor):
    """A copy pool that runs each task at once on the calling thread and records
    how many bytes it was given (a fake: no timing, no threads)."""

    def __init__(self) -> None:
        super().__init__(1)
        self.tasks: list[int] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.tasks.append(sum(e.length for e, _ in args[1]))
        fut: Future[Any] = Future()
        fut.set_result(fn(*args, **kwargs))
        return fut


def transformer_like(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """An embedding-sized array among hundreds of small ones, as a transformer's state."""
    arrays = {"embed": rng.standard_normal((3000, 1024), np.float32)}  # 11.7 MiB
    for i in range(300):
        arrays[f"layer{i}.w"] = rng.standard_normal((64, 64), np.float32)
        arrays[f"layer{i}.b"] = rng.standard_normal(64, np.float32)
    return arrays


def lay_out(arrays: dict[str, np.ndarray]) -> tuple[list[TensorEntry], mmap.mmap]:
    entries = plan_layout([(k, a.dtype, a.shape) for k, a in arrays.items()])
    size = sum(e.length for e in entries)
    return entries, mmap.mmap(-1, max(size, 1))


def assert_copied(mm: mmap.mmap, entries: list[TensorEntry], arrays: dict[str, Any]) -> None:
    for e in entries:
        got = np.frombuffer(mm, np.uint8, e.length, e.offset)
        assert got.tobytes() == np.ascontiguousarray(arrays[e.key]).tobytes(), e.key


def saver_with(copier: ThreadPoolExecutor, threads: int) -> Saver:
    """A client's saver (no daemon: only its copy is used) copying on ``copier``."""
    saver = Saver(
        None,  # type: ignore[arg-type]
        "job",
        0,
        [0],
        1,
        copy_threads=threads,
        staging_timeout=1.0,
        save_replicas=False,
        watched_stage=lambda: "local",
    )
    assert saver._copier is not None
    saver._copier.shutdown()
    saver._copier = copier
    return saver


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_each_copy_thread_copies_an_equal_share_of_the_bytes(threads: int) -> None:
    # Chunks of a fixed size left the calling thread a remainder (a few KiB here)
    # and the pool one task per 16 MiB: the caller and each pool thread now get
    # one part each, of equal bytes, the embedding cut where a part ends.
    arrays = transformer_like(np.random.default_rng(0))
    entries, mm = lay_out(arrays)
    total = sum(e.length for e in entries)
    copier = RecordingCopier()
    saver_with(copier, threads).copy_arrays(mm, entries, arrays)
    assert len(copier.tasks) == threads - 1
    caller = total - sum(copier.tasks)
    for part in [caller, *copier.tasks]:
        assert abs(part - total / threads) <= 4  # one float32 at most
    assert_copied(mm, entries, arrays)
    copier.shutdown()


def test_a_small_save_stays_on_the_calling_thread() -> None:
    arrays = {f"a{i}": np.full(1000, i, np.float32) for i in range(10)}
    entries, mm = lay_out(arrays)
    assert sum(e.length for e in entries) < 2 * MIN_PART
    copier = RecordingCopier()
    copy_into(mm, entries, arrays, copier, 4)
    assert copier.tasks == []
    assert_copied(mm, entries, arrays)
    copier.shutdown()


def odd_arrays(rng: np.random.Generator) -> dict[str, Any]:
    """Strided, transposed, empty, scalar and odd-sized arrays of several dtypes."""
    big = rng.standard_normal((300, 200), np.float64)
    return {
        "transposed": big.T,  # not C-contiguous: cut by rows only
        "every_other_row": big[::2],
        "one_strided_row": big[:1, ::3],  # cannot be cut at all
        "scalar": np.full((), 3.5, np.float32),
        "empty": np.zeros((0, 7), np.float32),
        "bytes": rng.integers(0, 255, 12345, dtype=np.uint8),
        "halves": rng.standard_normal(777).astype(np.float16),
        "complex": (rng.standard_normal(501) + 1j).astype(np.complex128),
        "ints": rng.integers(-9, 9, (33, 17), dtype=np.int64),
        "contiguous": rng.standard_normal((400, 3), np.float32),
    }


@pytest.mark.parametrize("parts", [1, 2, 3, 5, 8])
def test_parts_cover_every_byte_once_in_order_and_balanced(parts: int) -> None:
    arrays = odd_arrays(np.random.default_rng(parts))
    entries, mm = lay_out(arrays)
    total = sum(e.length for e in entries)
    split = split_by_bytes(entries, arrays, parts)
    assert len(split) == parts
    pieces = [p for part in split for p in part]
    at = 0
    for e, src in pieces:  # back to back, in lease order: each byte exactly once
        assert e.offset == at and e.length == src.nbytes > 0
        at += e.length
    assert at == total

    # A part ends at the nearest place the array there can be cut (an element of a
    # C-contiguous one, a row of another, nowhere in a single strided row): the
    # widest such unit bounds how far a part may be from an equal share.
    def unit(e: TensorEntry) -> int:
        a = arrays[e.key]
        if a.flags.c_contiguous:
            return e.dtype.itemsize
        return e.length // a.shape[0] if a.ndim and a.shape[0] > 1 else e.length

    widest = max(unit(e) for e in entries if e.length)
    for part in split:
        got = sum(e.length for e, _ in part)
        assert abs(got - total / parts) <= widest
    for part in split:  # each part copied alone still lands every byte in its place
        copy_into(mm, [e for e, _ in part], {e.key: s for e, s in part}, None)
    assert_copied(mm, entries, arrays)
