"""The copy of a save's arrays into its lease: cut into parts by bytes that the
calling thread and the copy pool take in turn, every byte where the layout puts it
(whatever the arrays' strides)."""

from __future__ import annotations

import mmap
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from ckptd.client.copying import MIN_PART, copy_into, guided_ends, split_by_bytes
from ckptd.client.saver import Saver
from ckptd.core.format import TensorEntry, plan_layout


class BusyCopier(ThreadPoolExecutor):
    """A copy pool whose threads are all busy elsewhere (another save's copy, a
    device-to-host copy): it takes tasks and runs none of them (a fake: no timing)."""

    def __init__(self) -> None:
        super().__init__(1)
        self.tasks = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.tasks += 1
        fut: Future[Any] = Future()
        fut.set_result(None)
        return fut


class InlineCopier(ThreadPoolExecutor):
    """A copy pool that runs each task at once on the calling thread (a fake)."""

    def __init__(self) -> None:
        super().__init__(1)
        self.tasks = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.tasks += 1
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
def test_the_calling_thread_copies_whatever_the_pool_has_not_taken(threads: int) -> None:
    # Tasks of 16 MiB chunks left the calling thread a remainder of a few KiB and
    # waited for the pool: the calling thread now takes parts until none is left.
    arrays = transformer_like(np.random.default_rng(0))
    entries, mm = lay_out(arrays)
    copier = BusyCopier()
    saver_with(copier, threads).copy_arrays(mm, entries, arrays)
    assert copier.tasks == threads - 1
    assert_copied(mm, entries, arrays)
    copier.shutdown()


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_a_pool_thread_copies_whatever_the_caller_has_not_taken(threads: int) -> None:
    arrays = transformer_like(np.random.default_rng(1))
    entries, mm = lay_out(arrays)
    copier = InlineCopier()  # the first task runs before the caller takes a part
    saver_with(copier, threads).copy_arrays(mm, entries, arrays)
    assert copier.tasks == threads - 1
    assert_copied(mm, entries, arrays)
    copier.shutdown()


@pytest.mark.parametrize("total", [8 * 2**20, 2**30, 2**30 + 12345])
@pytest.mark.parametrize("threads", [2, 4])
def test_parts_shrink_from_a_share_of_the_bytes_down_to_the_minimum(
    total: int, threads: int
) -> None:
    ends = guided_ends(total, threads)
    sizes = [b - a for a, b in zip([0, *ends], ends, strict=False)]
    assert ends[-1] == total and sum(sizes) == total
    assert sizes[0] == max(total // (2 * threads), MIN_PART)
    head = sizes[:-1]  # the last part is what is left
    assert head == sorted(head, reverse=True) and all(s >= MIN_PART for s in head)


def test_a_small_save_stays_on_the_calling_thread() -> None:
    arrays = {f"a{i}": np.full(1000, i, np.float32) for i in range(10)}
    entries, mm = lay_out(arrays)
    assert sum(e.length for e in entries) < 2 * MIN_PART
    copier = BusyCopier()
    copy_into(mm, entries, arrays, copier, 4)
    assert copier.tasks == 0
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
def test_parts_cover_every_byte_once_in_order_and_end_where_asked(parts: int) -> None:
    arrays = odd_arrays(np.random.default_rng(parts))
    entries, mm = lay_out(arrays)
    total = sum(e.length for e in entries)
    ends = [total * (k + 1) // parts for k in range(parts)]
    split = split_by_bytes(entries, arrays, ends)
    assert len(split) == parts
    pieces = [p for part in split for p in part]
    at = 0
    for e, src in pieces:  # back to back, in lease order: each byte exactly once
        assert e.offset == at and e.length == src.nbytes > 0
        at += e.length
    assert at == total

    # A part ends at the nearest place the array there can be cut (an element of a
    # C-contiguous one, a row of another, nowhere in a single strided row): the
    # widest such unit bounds how far from where it was asked to a part may end.
    def unit(e: TensorEntry) -> int:
        a = arrays[e.key]
        if a.flags.c_contiguous:
            return e.dtype.itemsize
        return e.length // a.shape[0] if a.ndim and a.shape[0] > 1 else e.length

    widest = max(unit(e) for e in entries if e.length)
    for k in range(parts):
        end = sum(e.length for p in split[: k + 1] for e, _ in p)
        assert abs(end - ends[k]) <= widest
    for part in split:  # each part copied alone still lands every byte in its place
        copy_into(mm, [e for e, _ in part], {e.key: s for e, s in part}, None)
    assert_copied(mm, entries, arrays)
