"""``dcp.async_save`` staged straight into the daemon's shared memory: the one copy.

DCP's default stager copies the whole state into new CPU memory (allocated again at
every save), and a storage writer then copies it once more. :class:`LeaseStage`
copies each tensor once, into a lease of the node daemon laid out as the rank
file's data section, and returns the state dict with its tensors replaced by views
of that memory, so training may go on at once. When DCP then asks the writer to
write, the tensors it resolves are those views: the writer commits the lease as it
lies (:meth:`ckptd.client.low_level.LowLevel.commit_in_place`), with the pickled objects and,
on the coordinator, DCP's metadata appended in the headroom left for them.

Whatever does not fit that shape (an item DCP did not write, leaving a hole; an
object larger than the headroom) falls back to a plain save: every item copied
into a fresh lease. So does a writer DCP moved to its checkpoint process (the
lease is this process's; the staged tensors arrive there as copies).
"""

from __future__ import annotations

import copy
import ctypes
import mmap
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptd.core.format import TensorEntry, round_up

from ..client import Client
from ..leaves.torch_tensors import to_array

HEADROOM_BASE = 256 * 2**10
HEADROOM_PER_OBJECT = 8 * 2**10
"""Room after the tensors for DCP's pickled objects (``torch.save`` of each: a zip of a
few KiB) and, on the coordinator, its pickled ``Metadata`` (~0.5 KiB an item)."""
HEADROOM_PER_TENSOR = 1024


@dataclass
class LeaseStage:
    """A state dict copied into one lease: where it lies, and room after it."""

    client: Client
    lease: Any
    mm: mmap.mmap
    tensors_end: int
    """Bytes of the staged tensors, from the start of the lease."""
    cursor: int = field(init=False)
    """Where the next appended item goes (after the tensors)."""
    failed: bool = False
    """Something did not fit: the save copies into a lease of its own instead."""
    done: bool = False
    """Committed or given back."""

    def __post_init__(self) -> None:
        self.cursor = self.tensors_end

    def holds(self, t: torch.Tensor) -> int | None:
        """The offset of ``t``'s bytes in the lease if it is one of the staged tensors as
        staged (CPU, contiguous, inside the tensors' region); else None."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        offset = t.data_ptr() - _address(self.mm)
        return offset if offset >= 0 and offset + t.nbytes <= self.tensors_end else None

    def append(self, data: np.ndarray) -> np.ndarray | None:
        """Copy ``data`` into the headroom (aligned to its item size); a view of the copy,
        or None if it does not fit."""
        at = round_up(self.cursor, max(1, data.dtype.itemsize))
        if at != self.cursor or at + data.nbytes > len(self.mm):
            return None  # padding would leave a hole; or no room
        view = np.ndarray(data.shape, data.dtype, buffer=self.mm, offset=at)
        np.copyto(view, data, casting="no")
        self.cursor = at + data.nbytes
        return view

    def compact(self, tree: dict[str, Any]) -> dict[str, Any] | None:
        """``tree`` (nested dicts of numpy views of this lease) with its arrays moved
        down over the holes between them (staged tensors DCP did not write here: a
        replicated value another rank writes): a commit needs them back to back.
        Tensors were staged largest alignment first and smallest first last, so a move
        keeps every alignment and is short. None if two overlap."""
        base = _address(self.mm)
        flat: list[tuple[int, list[Any], Any, np.ndarray]] = []
        _views(tree, flat, base)
        at = 0
        for offset, parent, key, arr in sorted(flat, key=lambda f: f[0]):
            if not arr.nbytes:
                continue
            if offset < at or at % arr.dtype.alignment:
                return None
            if offset > at:
                ctypes.memmove(base + at, base + offset, arr.nbytes)
                parent[key] = np.ndarray(arr.shape, arr.dtype, buffer=self.mm, offset=at)
            at += arr.nbytes
        return tree

    def release(self) -> None:
        """Give the lease back (the save did not commit it)."""
        if not self.done:
            self.done = True
            self.client.low_level.release(self.lease)


class Unsupported(Exception):
    """A state this stager does not stage (DCP's own stager does instead)."""


def stage(client: Client, state_dict: Any, coordinator: bool) -> tuple[Any, LeaseStage]:
    """Copy every tensor of ``state_dict`` into one new lease of ``client``; the staged
    state dict (tensors replaced by views of the lease, other objects deep-copied, as
    DCP's stager does) and the stage. Raises :class:`Unsupported` for DTensors off the
    CPU (their staged copy would be moved back to their device)."""
    found: list[torch.Tensor] = []
    objects = [0]
    _collect(state_dict, found, objects)
    # Largest alignment first (no padding between them), the largest tensors first
    # within it: what DCP leaves out on this rank (small replicated values another
    # rank writes) tends to lie last, where closing its hole moves little.
    order = sorted(range(len(found)), key=lambda i: (-_alignment(found[i]), -found[i].nbytes))
    offsets = [0] * len(found)
    at = 0
    for i in order:
        offsets[i] = at
        at += found[i].nbytes
    headroom = HEADROOM_BASE + HEADROOM_PER_OBJECT * objects[0]
    if coordinator:
        headroom += HEADROOM_PER_TENSOR * len(found)
    lease, mm = client.low_level.lease(at + headroom)
    pending = None
    try:
        # CPU tensors as numpy views, over the client's copy threads in batches (~2x
        # faster here than a torch copy_ each); CUDA ones straight from the device
        # (queued first, so they run while the host copies do); others (another
        # accelerator's) with torch's copy.
        entries, arrays, cuda_entries, cuda = [], {}, [], {}
        for i, (t, off) in enumerate(zip(found, offsets, strict=True)):
            if t.nbytes and t.device.type in ("cpu", "cuda"):
                arr, _ = to_array(t, keep_device=True)
                key = str(i)
                entry = TensorEntry(key, arr.dtype, tuple(arr.shape), off, arr.nbytes)
                if t.device.type == "cuda":
                    cuda_entries.append(entry)
                    cuda[key] = arr
                else:
                    entries.append(entry)
                    arrays[key] = arr
        if cuda:
            pending = client.low_level.device_copies().start(mm, cuda_entries, cuda)
        client.low_level.copy_arrays(mm, entries, arrays)
        views = [
            _copy_into(mm, t, off, copied=str(i) in arrays or str(i) in cuda)
            for i, (t, off) in enumerate(zip(found, offsets, strict=True))
        ]
        staged = _rebuild(state_dict, iter(views))
        if pending is not None:
            pending.wait()  # the staged state holds the bytes when this returns
            pending = None
    except BaseException:
        if pending is not None:
            pending.wait()  # nothing may still write into a lease given back
        client.low_level.release(lease)
        raise
    return staged, LeaseStage(client, lease, mm, at)


def _views(x: Any, out: list[tuple[int, Any, Any, np.ndarray]], base: int) -> None:
    for k, v in x.items():
        if isinstance(v, dict):
            _views(v, out, base)
        else:
            out.append((v.__array_interface__["data"][0] - base, x, k, v))


def _alignment(t: torch.Tensor) -> int:
    return t.element_size()  # complex too: torch loads whole items (see tensors.to_tensor)


def _collect(x: Any, found: list[torch.Tensor], objects: list[int]) -> None:
    if isinstance(x, dict):
        for v in x.values():
            _collect(v, found, objects)
    elif isinstance(x, list | tuple):
        for v in x:
            _collect(v, found, objects)
    elif isinstance(x, torch.Tensor):
        local = _local(x)
        if local is not x and local.device.type != "cpu":
            raise Unsupported(f"a DTensor on {local.device}")
        found.append(local)
    else:
        objects[0] += 1


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes are saved: a DTensor's local shard (else ``t``)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _copy_into(mm: mmap.mmap, t: torch.Tensor, offset: int, copied: bool) -> torch.Tensor:
    """A contiguous view of ``t``'s place in ``mm`` at ``offset``, ``t`` copied there
    unless ``copied`` already."""
    if t.nbytes == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    raw = torch.frombuffer(mm, dtype=torch.uint8, count=t.nbytes, offset=offset)
    dst = raw.view(t.dtype).view(t.shape)
    if not copied:
        with torch.no_grad():
            dst.copy_(t)  # from a GPU: device to host
    return dst


def _rebuild(x: Any, views: Any) -> Any:
    """``x`` with each tensor replaced by the next view (the order of :func:`_collect`)."""
    if isinstance(x, dict):
        out = {k: _rebuild(v, views) for k, v in x.items()}
        if type(x) is not dict:
            try:
                return type(x)(out)  # an OrderedDict (a module's state_dict())
            except TypeError:
                pass
        return out
    if isinstance(x, list):
        return [_rebuild(v, views) for v in x]
    if isinstance(x, tuple):
        items = [_rebuild(v, views) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    if isinstance(x, torch.Tensor):
        view = next(views)
        if getattr(x, "_local_tensor", None) is not None:  # a DTensor: the same placement
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(
                view,
                x.device_mesh,  # type: ignore[attr-defined]
                x.placements,  # type: ignore[attr-defined]
                run_check=False,
                shape=x.shape,
                stride=x.stride(),
            )
        return view
    return copy.deepcopy(x)  # training may change it after save() returns


def _address(mm: mmap.mmap) -> int:
    view = np.frombuffer(mm, np.uint8)
    try:
        return int(view.__array_interface__["data"][0])
    finally:
        del view
