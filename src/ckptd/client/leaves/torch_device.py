"""CUDA tensors straight into a save's lease, and restored bytes onto the devices.

Save: the lease's mapping is page-locked for the driver once (``cudaHostRegister``;
it stays so while the client keeps the segment mapped), and each tensor is copied
device-to-host into its place there with ``non_blocking`` on a side stream of its
device: DMA at the bus's speed, no host buffer of torch's own first, and the
copies of a thousand tensors queued in one pass. The side stream first waits for
everything the trainer queued before ``save()``; the trainer's current stream then
waits for one event after the copies, so a kernel it queues after ``save()`` (the
next optimizer step writing the parameters in place) runs only once the bytes are
in the lease, while the trainer's Python thread goes on at once. Each source
tensor is marked used by the side stream (``record_stream``), so the caching
allocator does not hand its memory to another tensor before the copy has read it.

Restore: bytes read from the checkpoint's mapped files go to a CUDA target through
a few page-locked staging buffers taken in turn: a host copy into one while the
device copies the one before (pageable memory would make the driver stage every
byte through its own small pinned buffer, synchronously).

Where page-locking is refused (no driver support, a sandbox), the copies still
run, as synchronous copies into pageable memory; nothing else changes.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.utils.dlpack import from_dlpack

from ckptd.core.format import TensorEntry

from .device import DeviceTensor

log = logging.getLogger(__name__)

# torch's CUDA helpers carry no annotations: typed handles on them.
_Event = cast(Callable[[], Any], torch.cuda.Event)
_Stream = cast(Callable[[torch.device], Any], torch.cuda.Stream)
_cudart: Callable[[], Any] = torch.cuda.cudart

STAGING_BUFFERS = 4
"""Page-locked staging buffers a restore cycles through (one per copy in flight)."""
STAGING_BYTES = 32 * 2**20
"""The size of each: large enough that a copy runs well past its launch cost."""
SMALL_RESTORE = 2**20
"""Below this a tensor is restored with one plain copy (staging costs more)."""


@dataclass
class Pending:
    """Copies queued into a lease: wait for them before it is committed or given back."""

    events: list[Any] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)
    """The tensors copied from, held until the copies have read them (a jax array's
    memory, seen through DLPack, is not the caching allocator's to keep)."""

    def wait(self) -> None:
        """Block until every copy is done, each of them even after one failed (none may
        still write into the lease once this returns); then the sources are let go.
        Raises the first copy's error."""
        first: BaseException | None = None
        try:
            for event in self.events:
                try:
                    event.synchronize()
                except Exception as exc:
                    first = first or exc
        finally:
            self.sources.clear()
        if first is not None:
            raise first

    def wait_all(self) -> None:
        """:meth:`wait`, its error dropped (another error is on its way)."""
        with contextlib.suppress(Exception):
            self.wait()


class _Mapped:
    """A lease mapping as torch sees it: one byte tensor over all of it, page-locked
    for the driver when it allows."""

    def __init__(self, mm: mmap.mmap) -> None:
        self.bytes = torch.frombuffer(mm, dtype=torch.uint8)
        self.address = int(self.bytes.data_ptr())
        self.pinned = _register(self.address, len(mm))

    def close(self) -> None:
        if self.pinned:
            _unregister(self.address)
            self.pinned = False
        del self.bytes


class DeviceCopies:
    """The device-to-host copies of one client's saves (see the module docstring)."""

    def __init__(self) -> None:
        self._mapped: dict[int, _Mapped] = {}
        self._streams: dict[torch.device, Any] = {}

    def start(
        self, mm: mmap.mmap, entries: list[TensorEntry], tensors: dict[str, DeviceTensor]
    ) -> Pending:
        """Queue a copy of each entry's tensor into its place in ``mm``."""
        mapped = self._of(mm)
        by_device: dict[torch.device, list[tuple[TensorEntry, torch.Tensor]]] = {}
        for e in entries:
            t = tensors[e.key].tensor
            by_device.setdefault(t.device, []).append((e, t))
        pending = Pending()
        try:
            for device, items in by_device.items():
                side = self._stream(device)
                current = torch.cuda.current_stream(device)
                side.wait_stream(current)  # the copies see every write queued before save()
                with torch.cuda.stream(side), torch.no_grad():
                    for e, t in items:
                        dst = mapped.bytes[e.offset : e.offset + e.length]
                        dst = dst.view(t.dtype).view(t.shape)
                        dst.copy_(t, non_blocking=True)
                        t.record_stream(side)
                        pending.sources.append(t)
                    event = _Event()
                    event.record(side)
                current.wait_event(event)  # later writes on the trainer's stream wait
                pending.events.append(event)
        except BaseException:
            pending.wait()  # nothing may still be writing into a lease given back
            raise
        return pending

    def forget(self, mm: mmap.mmap) -> None:
        """``mm`` is about to be unmapped: unregister it and let go of its view."""
        mapped = self._mapped.pop(id(mm), None)
        if mapped is not None:
            mapped.close()

    def close(self) -> None:
        """Unregister every mapping (the client is closing)."""
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()

    def _of(self, mm: mmap.mmap) -> _Mapped:
        # By the mapping object: its view here keeps it alive (so its id unique) until
        # forget(), which the client calls before it unmaps a segment.
        mapped = self._mapped.get(id(mm))
        if mapped is None:
            mapped = self._mapped[id(mm)] = _Mapped(mm)
        return mapped

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = _Stream(device)
        return stream


def from_jax(shards: dict[str, Any], entries: list[TensorEntry]) -> dict[str, DeviceTensor]:
    """The shards of ``entries`` that live on a CUDA device, as tensors over the same
    memory (DLPack: no copy; jax waits for the array to be computed first), so they
    are copied into the lease as CUDA tensors are. Shards jax cannot export (a dtype
    DLPack lacks) or that are not on a CUDA device are left out: they take jax's own
    way to host."""
    out: dict[str, DeviceTensor] = {}
    for e in entries:
        try:
            t = from_dlpack(shards[e.key].data)
        except (TypeError, ValueError, RuntimeError, BufferError):
            continue
        if not t.is_cuda or t.nbytes != e.length:
            continue
        out[e.key] = DeviceTensor(t, e.dtype, tuple(e.shape))
    return out


def _register(address: int, size: int) -> bool:
    """Page-lock ``size`` bytes at ``address`` for the driver; False if refused."""
    try:
        cudart = _cudart()
        err = cudart.cudaHostRegister(address, size, 0)
    except (AttributeError, RuntimeError) as exc:
        log.info("device-to-host copies into pageable memory: %s", exc)
        return False
    if int(err) != 0:
        # A failed call leaves an error the next CUDA call would report: clear it.
        with contextlib.suppress(Exception):
            _cudart().cudaGetLastError()
        log.info("device-to-host copies into pageable memory: cudaHostRegister: %s", err)
        return False
    return True


def _unregister(address: int) -> None:
    with contextlib.suppress(Exception):
        _cudart().cudaHostUnregister(address)


class _Staging:
    """Page-locked buffers a restore copies through, each with the event of the
    device copy that last read it."""

    def __init__(self) -> None:
        self.buffers = [
            torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
            for _ in range(STAGING_BUFFERS)
        ]
        self.events: list[Any] = [None] * STAGING_BUFFERS
        self.next = 0

    def upload(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copy CPU ``source`` (contiguous, ``target``'s dtype and size) into CUDA
        ``target`` (contiguous) on the current stream, through the buffers."""
        src = source.reshape(-1).view(torch.uint8)
        dst = target.view(-1).view(torch.uint8)
        stream = torch.cuda.current_stream(target.device)
        for start in range(0, src.numel(), STAGING_BYTES):
            end = min(start + STAGING_BYTES, src.numel())
            i, self.next = self.next, (self.next + 1) % STAGING_BUFFERS
            if self.events[i] is not None:
                self.events[i].synchronize()  # the copy that read this buffer is done
            buf = self.buffers[i][: end - start]
            buf.copy_(src[start:end])
            dst[start:end].copy_(buf, non_blocking=True)
            event = self.events[i] = _Event()
            event.record(stream)


_STAGING: _Staging | None = None
_STAGING_LOCK = threading.Lock()  # restores on several threads take turns with it


def restore_into(target: torch.Tensor, source: torch.Tensor) -> bool:
    """Copy ``source`` (restored bytes in host memory) into CUDA ``target`` through
    page-locked staging, ordered on the current stream; False (nothing copied) where
    that does not apply: another dtype or shape (a cast), a non-contiguous one, or a
    small tensor."""
    global _STAGING
    if not (
        target.is_cuda
        and source.device.type == "cpu"
        and target.dtype == source.dtype
        and target.shape == source.shape
        and target.is_contiguous()
        and source.is_contiguous()
        and source.nbytes >= SMALL_RESTORE
    ):
        return False
    with _STAGING_LOCK:
        if _STAGING is None:
            try:
                _STAGING = _Staging()
            except RuntimeError as exc:  # no page-locked memory to be had
                log.info("restoring onto the device without staging: %s", exc)
                return False
        _STAGING.upload(target, source)
    return True
