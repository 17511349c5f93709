"""What one save copies into its lease, and which way: decided before a byte moves.

A save's array leaves go one of three ways (the save path: saver.py):

- host memory (numpy, CPU torch, and CPU jax arrays others may write: DLPack
  imports, zero-copy host buffers) is copied by the calling thread before
  ``save()`` returns;
- CUDA tensors, and jax arrays on a CUDA device when torch is there, are queued on
  the devices' copy engines at once (leaves/torch_device.py) and run while the
  calling thread copies the host arrays;
- the other jax arrays (on an accelerator, or trusted CPU ones:
  ``Client(trust_jax_arrays=True)``) are copied after ``save()`` returns, on a
  background thread: jax never writes an array it owns in place.

What the lease holds already, or what the trainer said did not change, is not
copied at all (changes.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from ckptd.core.format import TensorEntry

from .copying import cpu_views
from .leaves.device import jax_on_accelerator, jax_via_torch
from .planning import Arrays, SavePlan

if TYPE_CHECKING:
    from .leaves.jax_arrays import ShardPlan
    from .leaves.torch_device import DeviceCopies, Pending


@dataclass
class CopyPlan:
    """One save's copies, by who makes them and when."""

    host: dict[str, Any]
    """The host arrays by key (numpy views of CPU jax shards among them)."""
    now: list[TensorEntry]
    """Copied by the calling thread before ``save()`` returns, in lease order."""
    later: list[TensorEntry]
    """jax shards copied device-to-host after ``save()`` returns."""
    device: dict[str, ShardPlan]
    """The jax shards' plans, by key."""
    pending: Pending | None = None
    """The CUDA copies queued (None: none); whoever gives the lease up waits for them."""

    @property
    def after_return(self) -> bool:
        """Whether some copy runs after ``save()`` returns (the commit goes out while
        copies run: :meth:`~ckptd.client.handoff.Handoff.send_copying`)."""
        return bool(self.later) or self.pending is not None


class Routes:
    """Which way device arrays go, learnt once from the first save that holds them:
    jax on a CUDA device through torch's DLPack (and its copy engines), and whether
    jax's arrays are on an accelerator (their transfers start all at once)."""

    def __init__(self, device_copies: Callable[[], DeviceCopies]) -> None:
        self._device_copies = device_copies
        self._via_torch: bool | None = None
        self._accelerated: bool | None = None

    def via_torch(self, device: dict[str, ShardPlan]) -> bool:
        """jax arrays on a CUDA device go the way CUDA tensors do (DLPack)."""
        if self._via_torch is None:
            self._via_torch = jax_via_torch(device)
        return self._via_torch

    def accelerated(self, device: dict[str, ShardPlan]) -> bool:
        """jax arrays on an accelerator (not in host memory already)."""
        if self._accelerated is None:
            self._accelerated = jax_on_accelerator(device)
        return self._accelerated

    def start_transfers(self, copies: CopyPlan) -> None:
        """Every device-to-host transfer of ``copies.later`` starts now, at once (on an
        accelerator they overlap; one by one, each would wait for its own): the
        background copies find them done."""
        if copies.device and self.accelerated(copies.device):
            for e in copies.later:
                copies.device[e.key].data.copy_to_host_async()

    def plan(
        self,
        plan: SavePlan,
        arrays: Arrays,
        held: set[str],
        mm: Any,
        trust_jax_arrays: bool,
        what: str,
    ) -> CopyPlan:
        """The copies of a save laid out by ``plan`` (``held``: keys the lease holds
        already). CUDA copies it queued into ``mm`` are waited for if it raises."""
        host, device = arrays.host, arrays.device
        now = [e for e in plan.host_entries if e.key not in held] if held else plan.host_entries
        later = [e for e in plan.device_entries if e.key not in held]
        cuda = arrays.cuda or {}
        if device and self.via_torch(device):
            from .leaves.torch_device import from_jax

            cuda = {**cuda, **from_jax(device, later)}
        copies = CopyPlan(host, now, later, device)
        if cuda:
            # CUDA tensors first: their copies run on the devices' copy engines
            # while the calling thread copies the host arrays.
            queued = [e for e in (*now, *later) if e.key in cuda]
            copies.pending = self._device_copies().start(mm, queued, cuda)
            copies.now = [e for e in now if e.key not in cuda]
            copies.later = [e for e in later if e.key not in cuda]
        if copies.later and not trust_jax_arrays:
            # CPU memory others may write (DLPack, numpy): copied before returning.
            try:
                cpu, views, copies.later = cpu_views(copies.later, device, what)
            except BaseException:
                if copies.pending is not None:
                    copies.pending.wait()  # nothing may write into a lease given back
                raise
            copies.host = {**host, **views}
            copies.now = sorted([*copies.now, *cpu], key=attrgetter("offset"))
        return copies
