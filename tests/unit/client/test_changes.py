"""The change tokens of client/changes.py: a jax array's identity says its bytes did
not change only for memory that nothing but jax can write, or when the trainer says
so (``trust_jax_arrays``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

jax = pytest.importorskip("jax")

from ckptd.client.changes import jax_exclusive, same, token_of  # noqa: E402
from ckptd.client.planning import Planner  # noqa: E402


@dataclass(frozen=True)
class FakeDevice:
    platform: str


@dataclass(frozen=True)
class FakeSharding:
    device_set: frozenset[FakeDevice]
    memory_kind: str | None = "device"


@dataclass(eq=False)
class FakeArray:
    """What the token rule reads of a ``jax.Array``: its sharding."""

    sharding: FakeSharding
    shape: tuple[int, ...] = field(default=(4,))


def on(*platforms: str, memory_kind: str | None = "device") -> FakeArray:
    return FakeArray(FakeSharding(frozenset(FakeDevice(p) for p in platforms), memory_kind))


def test_a_cpu_jax_array_has_no_token_unless_trusted() -> None:
    a = jax.numpy.arange(8.0)
    assert not jax_exclusive(a)  # DLPack and zero-copy numpy share CPU memory
    assert token_of(a, ((0, 8),)) is None
    trusted = token_of(a, ((0, 8),), trust_jax=True)
    assert trusted is not None and same(trusted, token_of(a, ((0, 8),), trust_jax=True))
    assert not same(trusted, token_of(a + 0, ((0, 8),), trust_jax=True))  # another array


@pytest.mark.parametrize(
    ("array", "exclusive"),
    [
        (on("tpu"), True),  # jax alone writes a TPU's memory (no DLPack, no pointers)
        (on("tpu", memory_kind=None), True),  # (the default memory: the device's)
        (on("tpu", "tpu"), True),
        (on("tpu", memory_kind="pinned_host"), False),  # host memory
        (on("tpu", memory_kind="unpinned_host"), False),
        (on("gpu"), False),  # DLPack, __cuda_array_interface__
        (on("cuda"), False),
        (on("rocm"), False),
        (on("cpu"), False),
        (on("tpu", "cpu"), False),
        (on("METAL"), False),  # a platform not known to keep its memory to itself
    ],
)
def test_only_memory_jax_alone_can_write_is_told_by_identity(
    array: FakeArray, exclusive: bool
) -> None:
    assert jax_exclusive(array) is exclusive
    token = token_of(array, ((0, 4),))
    assert (token is not None) is exclusive
    assert token_of(array, ((0, 4),), trust_jax=True) is not None  # the trainer's word


def test_the_planner_takes_jax_tokens_only_when_trusted_on_cpu() -> None:
    tree = {"a": jax.numpy.arange(8.0), "b": jax.numpy.ones(4)}
    _, arrays = Planner().plan(tree, track=True)
    assert arrays.tokens == {"a#0": None, "b#0": None}
    _, arrays = Planner().plan(tree, track=True, trust_jax=True)
    assert arrays.tokens is not None and all(arrays.tokens.values())
