"""The trees the checker's trainers save: three arrays whose bytes are a pure function
of (array, version), so the model stores version numbers and rebuilds the bytes.

Flavors: ``numpy``, ``torch``, ``jax`` (a frozen array is the very same jax object
again, which the client may skip copying) and ``jax-alias``: jax arrays that alias
torch tensors' memory (``jax.dlpack.from_dlpack``), changed by writing the tensors in
place, so a changed array is still the same jax object. Versions come from a small
range, so different saves (and different runs) often hold equal bytes.

Importable by the trainer subprocesses (plain numpy; torch and jax on demand).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

KEYS = ("a", "b", "c")
SIZES = {"a": 2048, "b": 16384, "c": 256}
"""float32 elements of each array (8 KiB, 64 KiB, 1 KiB): small, so a save is fast."""
FLAVORS = ("numpy", "torch", "jax", "jax-alias")


@functools.cache
def content(key: str, version: int) -> np.ndarray:
    """The bytes array ``key`` holds at ``version`` (read-only, cached)."""
    rng = np.random.default_rng([KEYS.index(key), version])
    out = rng.standard_normal(SIZES[key], dtype=np.float32)
    out.flags.writeable = False
    return out


def expected(versions: tuple[int, ...]) -> dict[str, bytes]:
    """Each array's bytes for these versions."""
    return {k: content(k, v).tobytes() for k, v in zip(KEYS, versions, strict=True)}


class Arrays:
    """One trainer's live arrays of one flavor: :meth:`set` changes the arrays whose
    version moved (a frozen one stays the very same object), :meth:`tree` is what a
    save hands over."""

    def __init__(self, flavor: str, versions: tuple[int, ...]) -> None:
        self.flavor = flavor
        self.versions = versions
        self._leaves: dict[str, Any] = {}
        self._tensors: dict[str, Any] = {}  # jax-alias: the torch memory jax reads
        for key, v in zip(KEYS, versions, strict=True):
            self._make(key, v)

    def _make(self, key: str, version: int) -> None:
        data = content(key, version)
        if self.flavor == "numpy":
            self._leaves[key] = data.copy()
        elif self.flavor == "torch":
            import torch

            self._leaves[key] = torch.from_numpy(data.copy())
        elif self.flavor == "jax":
            import jax.numpy as jnp

            self._leaves[key] = jnp.asarray(data)
        elif self.flavor == "jax-alias":
            import jax
            import torch

            # torch's own allocation: aligned as jax needs to alias it (it copies a
            # tensor it cannot alias, and the arrays would not share memory)
            tensor = torch.empty(SIZES[key], dtype=torch.float32)
            tensor.copy_(torch.from_numpy(data.copy()))
            leaf = jax.dlpack.from_dlpack(tensor)
            if leaf.unsafe_buffer_pointer() != tensor.data_ptr():
                raise AssertionError("jax copied the tensor instead of aliasing it")
            self._tensors[key], self._leaves[key] = tensor, leaf
        else:
            raise ValueError(f"unknown flavor {self.flavor!r}; use one of {FLAVORS}")

    def set(self, versions: tuple[int, ...]) -> None:
        """Move to ``versions``: changed arrays get their new bytes, frozen ones stay."""
        for key, old, new in zip(KEYS, self.versions, versions, strict=True):
            if old == new:
                continue
            if self.flavor == "jax-alias":
                import torch

                self._tensors[key].copy_(torch.from_numpy(content(key, new).copy()))
            else:
                self._make(key, new)
        self.versions = versions

    def tree(self) -> dict[str, Any]:
        """The tree a save hands over (its leaves, not copies)."""
        return dict(self._leaves)


def leaf_bytes(leaf: Any) -> bytes:
    """A restored leaf's bytes (numpy, torch or jax alike)."""
    if hasattr(leaf, "numpy") and type(leaf).__module__.startswith("torch"):
        return bytes(leaf.numpy().tobytes())
    return bytes(np.asarray(leaf).tobytes())


def differences(tree: Any, versions: tuple[int, ...]) -> list[str]:
    """How a restored tree differs from the bytes of ``versions`` (empty: bit-exact)."""
    if not isinstance(tree, dict) or set(tree) != set(KEYS):
        keys = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
        return [f"the tree's keys are {keys}, not {list(KEYS)}"]
    out = []
    for key, want in expected(versions).items():
        got = leaf_bytes(tree[key])
        if got != want:
            which = [v for v in range(8) if content(key, v).tobytes() == got]
            seen = f"the bytes of version {which[0]}" if which else "bytes of no version"
            out.append(f"array {key!r} holds {seen}, not version {versions[KEYS.index(key)]}")
    return out
