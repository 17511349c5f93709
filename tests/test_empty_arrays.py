"""Saves whose arrays hold no bytes: a zero-size array is state like any other, and a
save of nothing but such arrays commits and restores like any other save."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from .conftest import Daemon


def _same(got: Any, want: Any) -> None:
    """Bit-exact: the same shape, dtype and bytes."""
    a, b = np.asarray(got), np.asarray(want)
    assert (a.shape, a.dtype) == (b.shape, b.dtype)
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("shared_memory", [True, False])
def test_save_of_only_empty_arrays_commits_and_restores(
    daemon: Daemon, shared_memory: bool
) -> None:
    client = daemon.client("empty")
    state = {
        "z": np.zeros((0,), np.float32),
        "m": np.zeros((3, 0, 2), np.int64),
        "b": np.zeros((0, 5), np.bool_),
    }
    client.save(1, state).wait("local")
    tree, _ = client.restore(step=1, shared_memory=shared_memory)
    assert set(tree) == set(state)
    for k, v in state.items():
        _same(tree[k], v)


def test_empty_arrays_mixed_with_data_restore_bit_exact(daemon: Daemon) -> None:
    client = daemon.client("mixed-empty")
    state = {
        "a": np.zeros((0,), np.float16),
        "w": np.arange(1000, dtype=np.float32),
        "m": np.zeros((0, 4), np.uint8),
        "s": np.array(7, np.int32),
        "z": np.zeros((2, 0), np.float64),  # last in the file: past every byte of data
    }
    client.save(1, state).wait("local")
    tree, _ = client.restore(step=1)
    for k, v in state.items():
        _same(tree[k], v)


def test_empty_torch_tensors_commit_and_restore(daemon: Daemon) -> None:
    torch = pytest.importorskip("torch", reason="the torch case needs torch")
    client = daemon.client("empty-torch")
    only = {"e": torch.empty(0), "f": torch.zeros((0, 3), dtype=torch.bfloat16)}
    client.save(1, only).wait("local")
    client.save(2, {**only, "w": torch.arange(10.0)}).wait("local")
    for step, state in ((1, only), (2, {**only, "w": torch.arange(10.0)})):
        tree, _ = client.restore(step=step)
        for k, v in state.items():
            assert isinstance(tree[k], torch.Tensor)
            assert (tree[k].shape, tree[k].dtype) == (v.shape, v.dtype)
            assert torch.equal(tree[k], v)


def test_empty_jax_arrays_commit_and_restore(daemon: Daemon) -> None:
    jax = pytest.importorskip("jax", reason="the jax case needs jax")
    client = daemon.client("empty-jax")
    state = {"e": jax.numpy.zeros((0,), np.float32), "f": jax.numpy.zeros((0, 2), np.int32)}
    client.save(1, state).wait("local")
    tree, _ = client.restore(step=1)
    for k, v in state.items():
        _same(tree[k], v)
    like = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()
    }
    tree, _ = client.restore(step=1, target=like)
    for k, v in state.items():
        assert isinstance(tree[k], jax.Array)
        _same(tree[k], v)
