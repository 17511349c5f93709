"""A tensor leaf whose bytes are in accelerator memory, as a save plans it.

Planning needs a leaf's dtype and shape only; the bytes of an accelerator's tensor
go straight from the device into the save's lease (``ckptd.client.leaves.torch_device``),
with no copy to host memory of its own first. This module imports no framework, so
the planner can tell such a leaf apart without importing torch.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class DeviceTensor:
    """A torch tensor on an accelerator, seen as the numpy array it is saved as."""

    tensor: Any
    """The tensor to copy: detached, with any lazy conjugation or negation resolved,
    and viewed as the unsigned integer of its item size when its dtype is recorded by
    torch's name (the same bytes)."""
    dtype: np.dtype
    """The numpy dtype the manifest records."""
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """The bytes it takes in the lease."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def jax_on_accelerator(shards: dict[str, Any]) -> bool:
    """Whether a process's jax shards (``ShardPlan`` by key) live on an accelerator, as
    the first one does: only there does a save start their device-to-host copies
    early (a CPU array is in host memory already). Asked once per client."""
    data = next(iter(shards.values())).data
    return bool(next(iter(data.devices())).platform != "cpu")


ShardingFacts = dict[int, tuple[Any, bool]]
"""What is known of each sharding seen (jax arrays share a few), by its id; the
sharding is kept, so that an id reused by another is told apart."""


def sharding_fact(facts: ShardingFacts, array: Any, decide: Callable[[Any], bool]) -> bool:
    """``decide(sharding)`` of jax array ``array``'s sharding, asked once per sharding
    (a save of thousands of arrays asks for each)."""
    sharding = array.sharding
    hit = facts.get(id(sharding))
    if hit is None or hit[0] is not sharding:
        if len(facts) > 1024:
            facts.clear()
        hit = facts[id(sharding)] = (sharding, bool(decide(sharding)))
    return hit[1]


_CPU: ShardingFacts = {}


def jax_on_cpu(array: Any) -> bool:
    """Whether jax array ``array`` lies on CPU devices: in host memory, which numpy,
    torch and DLPack share with it (client/changes.py)."""
    return sharding_fact(_CPU, array, lambda s: all(d.platform == "cpu" for d in s.device_set))


def jax_via_torch(shards: dict[str, Any]) -> bool:
    """Whether a process's jax shards (``ShardPlan`` by key) live on a GPU and torch is
    there to copy them into the lease as CUDA tensors (DLPack): jax's own way to host,
    through host buffers of its own, took several times that copy on an H200
    (bench/bench_gpu.py). Asked once per client; torch is imported then if installed."""
    data = next(iter(shards.values())).data
    if next(iter(data.devices())).platform != "gpu":
        return False
    return "torch" in sys.modules or importlib.util.find_spec("torch") is not None
