"""Exact change signals: which shards of a save are, for certain, the very bytes
this process saved at an earlier step (incremental saves, docs/architecture.md).

Each save records a *token* per shard key, taken as it is planned:

- a torch tensor: its storage (a weak reference: a storage freed and another
  allocated at the same address is another object, and a dead reference never
  matches; the storage fixes the device), data pointer, storage offset, shape,
  strides, dtype, its lazy conjugate and negative bits, and ``_version``, the
  counter every in-place torch operation bumps (``add_``, ``copy_``, an optimizer's
  step, under ``no_grad`` too), shared by its views, ``detach()`` and the tensors
  of a ``state_dict()``;
- a jax array shard: the very same array object (weakly referenced) and the
  shard's index;
- anything else (numpy arrays, inference-mode tensors, which keep no version): no
  token, so never unchanged; the daemon compares strong digests instead.

A shard is unchanged since step S when its token equals the one recorded at S.
Neither kind of token is proof everywhere, so each is taken only where it is:

- jax never writes an array once made, but others can write its memory: on CPU and
  GPU an array shares memory through DLPack both ways (``jax.dlpack.from_dlpack`` of
  a torch tensor, ``torch.from_dlpack`` of a jax array), through
  ``__cuda_array_interface__`` (``jnp.asarray`` of a CuPy array), and
  ``jax.device_put`` / ``jnp.asarray`` of an aligned numpy array on CPU take its
  memory as it is; jax cannot tell whether an array's memory is shared. So a jax
  array's token is taken only for memory nobody but jax can write (:func:`jax_exclusive`:
  device memory of a TPU), or when the client is told to trust them
  (``Client(trust_jax_arrays=True)``);
- a torch tensor's is only as good as ``_version``, and torch does not count every
  write: writes through ``tensor.data`` (a detached alias with a version counter of
  its own), through a numpy view (``tensor.numpy()``, ``torch.from_numpy``), DLPack
  or a raw pointer, BatchNorm's running statistics (updated inside its kernel) and
  collectives such as ``dist.broadcast`` leave ``_version`` as it was. So torch
  tokens are taken only when the client is told to trust them
  (``Client(trust_torch_versions=True)``).

Shards without a token are copied at every save and the daemon compares digests.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress
from typing import Any

import numpy as np
import numpy.typing as npt

from ckptd.core.format import TensorEntry

from .leaves.device import ShardingFacts, sharding_fact

ENV = "CKPTD_INCREMENTAL"
"""Environment variable that turns incremental saves off (``0``) for every client."""
KEPT_STEPS = 4
"""Saved steps whose tokens are remembered: the daemon may grant the segment of any
recent one (the memory tier keeps the newest few before they return to the pool)."""

Token = tuple[Any, tuple[Any, ...]]
"""``(weak reference to the object, what else must be equal)``."""


def incremental_from_env(incremental: bool) -> bool:
    """``incremental`` unless :data:`ENV` turns it off; a value it does not know is
    refused with what to write instead."""
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("", "1", "true", "yes", "on"):
        return incremental
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(
        f"{ENV}={os.environ[ENV]!r} is not understood; set it to 0 to turn incremental "
        "saves off, or 1 (or leave it unset) to keep them on"
    )


EXCLUSIVE_PLATFORMS = frozenset({"tpu"})
"""Platforms whose device memory nothing but jax writes: jax exports and imports
memory (DLPack, ``__cuda_array_interface__``, zero-copy host buffers) on CPU and GPU
(jax/_src/array.py ``__dlpack_device__``); a platform not known to keep its memory
to itself counts as sharing it."""
DEVICE_MEMORY = frozenset({None, "device"})
"""Memory kinds that are the device's own memory (None: the default, the device's);
``pinned_host`` and ``unpinned_host`` are host memory, which numpy can share."""

_EXCLUSIVE: ShardingFacts = {}


def jax_exclusive(array: Any) -> bool:
    """Whether nothing but jax can write the memory of jax array ``array``: device
    memory on a platform of :data:`EXCLUSIVE_PLATFORMS` only."""
    return sharding_fact(_EXCLUSIVE, array, _exclusive)


def _exclusive(sharding: Any) -> bool:
    return getattr(sharding, "memory_kind", None) in DEVICE_MEMORY and all(
        d.platform in EXCLUSIVE_PLATFORMS for d in sharding.device_set
    )


def token_of(obj: Any, index: Any = None, trust_jax: bool = False) -> Token | None:
    """The token of a torch tensor or of a jax array's shard at ``index``; None for
    anything whose changes cannot be told exactly. A jax array has one only if its
    memory is jax's alone (:func:`jax_exclusive`) or ``trust_jax``."""
    if index is not None:  # a jax array: jax never writes it; nobody else may either
        if not (trust_jax or jax_exclusive(obj)):
            return None
        try:
            return weakref.ref(obj), (index,)
        except TypeError:
            return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return tensor_token(obj)
    return None


def tensor_token(t: Any) -> Token | None:
    """The token of torch tensor ``t``: ``(weak reference to its storage, (version,
    where))``, ``where`` being the tensor's place in that storage and how it reads it
    (~1 us: a save of thousands of tensors computes one each). The storage fixes the
    device; an inference tensor has no version counter (reading it raises), and so
    no token: its in-place writes cannot be told."""
    try:
        where = (
            t.data_ptr(),
            t.storage_offset(),
            t.shape,
            t.stride(),
            t.dtype,
            t.is_conj(),
            t.is_neg(),
        )
        return weakref.ref(t.untyped_storage()), (t._version, where)
    except (RuntimeError, TypeError, NotImplementedError):
        return None  # an inference tensor, or one without real storage (a subclass, meta)


def same(old: Token | None, new: Token | None) -> bool:
    """Whether two tokens say the same bytes: both exist, the object is alive and the
    very same (a live object's plain weak reference is one object: ``is``), and
    everything else is equal."""
    if old is None or new is None:
        return False
    return old[0] is new[0] and old[0]() is not None and old[1] == new[1]


@dataclass(frozen=True)
class Saved:
    """What one acknowledged save of this process left: its tokens and its layout."""

    tokens: dict[str, Token | None]
    entries: list[TensorEntry]
    """Where each shard lay in the lease (``data_offset`` 0)."""


class Changes:
    """The tokens of this process's last :data:`KEPT_STEPS` acknowledged saves of one
    job and rank, and what they say about the next save."""

    def __init__(self) -> None:
        self._saved: OrderedDict[int, Saved] = OrderedDict()
        self._highest = -1
        self.last: int | None = None
        """The step of the previous save, if it was acknowledged (None otherwise)."""

    def begin(self, step: int) -> bool:
        """A save of ``step`` begins; whether it may be recorded once acknowledged.

        Until it is, there is no previous save to name. A step number this process
        saved (or tried to) before is never recorded, and its earlier record goes: the
        daemon may hold either save's image under that number, and only one of them
        could be told apart from the other by what is recorded here."""
        self.last = None
        fresh = step > self._highest
        self._highest = max(self._highest, step)
        if not fresh:
            self._saved.pop(step, None)
        return fresh

    def acknowledged(self, step: int, saved: Saved | None) -> None:
        """``step`` was handed off; ``saved``: its tokens and layout, to be recorded."""
        if saved is not None:
            self._saved[step] = saved
        while len(self._saved) > KEPT_STEPS:
            self._saved.popitem(last=False)
        self.last = step

    def word(
        self,
        step: int,
        since: int | None,
        keys: Sequence[str],
        tokens: dict[str, Token | None] | None,
    ) -> npt.NDArray[np.bool_] | None:
        """The trainer's word to the daemon for a save of ``step`` laid out as ``keys``:
        per key, unchanged since the previous save ``since``, if that one was
        acknowledged and recorded (None: no word, the daemon compares digests)."""
        if tokens is None or since is None or since >= step:
            return None
        if all(t is None for t in tokens.values()):
            return None  # no shard has a token
        saved = self._saved.get(since)
        if saved is None:
            return None  # nothing recorded at `since`
        old, get = saved.tokens, tokens.get
        return np.fromiter((same(old.get(k), get(k)) for k in keys), bool, len(keys))

    def held(
        self,
        lease: Any,
        entries: list[TensorEntry],
        keys: Sequence[str],
        tokens: dict[str, Token | None] | None,
        since: int | None,
        word: npt.NDArray[np.bool_] | None,
    ) -> set[str]:
        """The shards ``lease`` (a ``pb.Lease``) holds already: it holds this process's
        image of a step laid out as ``entries``, and their tokens are what they were
        then. ``word``: :meth:`word` of this save, which tells it when the image is of
        step ``since`` (the usual case)."""
        if not (lease.holds_image and tokens):
            return set()
        saved = self.image_of(lease.holds_step, entries)
        if saved is None:
            return set()
        if word is not None and lease.holds_step == since:
            return set(compress(keys, word))
        old = saved.tokens
        return {k for k, t in tokens.items() if t is not None and same(old.get(k), t)}

    def image_of(self, step: int, entries: list[TensorEntry]) -> Saved | None:
        """What this process saved as ``step``, if it was laid out as ``entries`` are."""
        saved = self._saved.get(step)
        if saved is None or not (saved.entries is entries or saved.entries == entries):
            return None
        return saved


def packbits(mask: npt.NDArray[np.bool_]) -> bytes:
    """The wire form of a per-row mask (CommitShardsRequest.unchanged)."""
    return np.packbits(mask, bitorder="little").tobytes()
