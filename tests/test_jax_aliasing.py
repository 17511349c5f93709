"""jax arrays over memory that something else writes: every step restores the bytes
its arrays held when it was saved, however the memory was shared (DLPack from or to
torch, a zero-copy ``device_put`` of a numpy array) and whenever it is written
(between saves, or right after ``save()`` returned)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch", reason="these tests need torch (make venv installs it)")

from ckptd.client import Client  # noqa: E402

from .conftest import Daemon  # noqa: E402

KEEP_ALL = ["--retention-local", "KeepLatest(20)"]
"""Every step of a test stays restorable locally."""


@pytest.fixture
def keep_all(make_daemon: Any) -> Daemon:
    """A daemon that keeps every step (with its memory tier: the newest step's segment
    is kept and may be granted back to the client)."""
    d: Daemon = make_daemon(extra_args=KEEP_ALL)
    return d


def shares(a: Any, address: int) -> bool:
    """Whether jax array ``a`` lies at ``address`` (the memory is shared, not copied)."""
    return int(a.unsafe_buffer_pointer()) == address


def restores(client: Client, saved: dict[int, dict[str, np.ndarray]]) -> None:
    """Each step restores bit-exact what it held, from shared memory (the memory tier
    or the disk read into a segment) and from its files mapped copy-on-write."""
    for shm in (True, False):
        for step, want in saved.items():
            got, _ = client.restore(step=step, shared_memory=shm)
            for k, v in want.items():
                assert np.asarray(got[k]).tobytes() == v.tobytes(), (step, k, shm)


def test_a_jax_array_over_a_torch_tensor_restores_what_it_held_at_each_save(
    keep_all: Daemon,
) -> None:
    """DLPack import: the jax array is the same object at every save while torch
    writes its memory in place, right after each save() returns."""
    t = torch.arange(64 * 1024, dtype=torch.float32)
    arr = jax.dlpack.from_dlpack(t)
    assert shares(arr, t.data_ptr())
    frozen = jax.numpy.ones(4096)  # jax's own, never written
    client = keep_all.client("from-torch")
    saved: dict[int, dict[str, np.ndarray]] = {}
    for step in range(1, 6):
        saved[step] = {"a": t.numpy().copy(), "frozen": np.asarray(frozen).copy()}
        handle = client.save(step, {"a": arr, "frozen": frozen})
        t.add_(1)  # the next training step, at once
        handle.wait("local", 60)
    restores(client, saved)


def test_a_jax_array_exported_to_torch_and_written_there_restores_what_it_held(
    keep_all: Daemon,
) -> None:
    """DLPack export: torch writes a jax-made array's memory in place."""
    arr = jax.numpy.arange(64 * 1024, dtype=jax.numpy.float32)
    t = torch.from_dlpack(arr)
    assert shares(arr, t.data_ptr())
    client = keep_all.client("to-torch")
    saved: dict[int, dict[str, np.ndarray]] = {}
    for step in range(1, 6):
        saved[step] = {"a": t.numpy().copy()}
        client.save(step, {"a": arr}).wait("local", 60)
        t.mul_(2).add_(step)
    restores(client, saved)


def test_a_jax_array_put_over_a_numpy_array_restores_what_it_held(keep_all: Daemon) -> None:
    """``jax.device_put`` of an aligned numpy array on CPU takes its memory as it is."""
    memory = np.zeros(64 * 1024 + 16, np.float32)
    start = (-memory.ctypes.data) % 64 // 4  # 64-byte aligned: what jax shares
    host = memory[start : start + 64 * 1024]
    arr = jax.device_put(host)
    if not shares(arr, host.ctypes.data):
        pytest.skip("this jax copies numpy arrays on device_put")
    client = keep_all.client("from-numpy")
    saved: dict[int, dict[str, np.ndarray]] = {}
    for step in range(1, 6):
        saved[step] = {"a": host.copy()}
        client.save(step, {"a": arr}).wait("local", 60)
        host += 1
    restores(client, saved)


def test_an_aliased_array_written_before_a_background_copy_ran_is_saved_as_it_was(
    daemon: Daemon,
) -> None:
    """save() returns with the jax arrays copied when nothing vouches for them: a write
    right after it never reaches the step, however long a client thread would take."""
    t = torch.zeros(64 * 1024)
    arr = jax.dlpack.from_dlpack(t)
    client = daemon.client("copied-first")
    gate = threading.Event()
    client._saver._background.submit(gate.wait)  # a copy after save() would queue here
    try:
        handle = client.save(1, {"a": arr})
        t.add_(1)
    finally:
        gate.set()
    handle.wait("local", 60)
    got, _ = client.restore(step=1)
    assert not np.asarray(got["a"]).any()


def test_trusted_jax_arrays_are_skipped_as_the_same_objects(make_daemon: Any) -> None:
    """The control, ``trust_jax_arrays=True``: a jax array that is the same object is
    taken as unchanged (neither copied nor compared), which is what the trainer vouches
    for: here its memory changed behind jax, and the step carries the old bytes."""
    t = torch.zeros(64 * 1024)
    arr = jax.dlpack.from_dlpack(t)
    # No memory tier: the segment of step 1 goes back to the pool, holding its image.
    daemon = make_daemon(extra_args=["--memory-tier-steps", "0", *KEEP_ALL])
    client = daemon.client("trusted", trust_jax_arrays=True)
    client.save(1, {"a": arr}).wait("local", 60)
    t.add_(1)
    handle = client.save(2, {"a": arr})
    handle.wait("local", 60)
    got, _ = client.restore(step=2)
    assert not np.asarray(got["a"]).any()  # what the trainer's word said
    assert handle.reused_bytes == t.nbytes
