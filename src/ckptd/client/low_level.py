"""What framework adapters (Orbax, HF, DCP, torchtitan, Lightning) ask of the daemon
beyond :class:`ckptd.client.Client`'s own surface: ``client.low_level``.

A trainer never needs these; an adapter does: a lease it fills itself and commits
as it lies, a directory the daemon watches or fills, the daemon's status, other
nodes' parts of a step. Every call is typed (the request and response messages
of :mod:`ckptd.proto.ckptd_pb2`).
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING, Any

from ckptd.core.format import TensorEntry
from ckptd.core.session import open_readable
from ckptd.core.wire import Connection
from ckptd.proto import ckptd_pb2 as pb

from .handle import SaveHandle
from .saver import Saver

if TYPE_CHECKING:
    from .leaves.torch_device import DeviceCopies


class LowLevel:
    """The adapters' calls for one client's ``job`` and ``rank``."""

    def __init__(self, connection: Connection, job: str, rank: int, saver: Saver) -> None:
        self.connection = connection
        self.job = job
        self.rank = rank
        self._saver = saver

    # -- the daemon --------------------------------------------------------------
    def status(self) -> pb.DaemonStatus:
        """The daemon's status (its node, root, remote tier, memory)."""
        return self.connection.get_status(pb.GetStatusRequest())

    def watch(self, directory: str = "") -> pb.WatchResponse:
        """Have the daemon adopt every finished step written under ``directory``
        (default: ``<root>/.orbax/<job>``); the directory it watches."""
        return self.connection.watch(pb.WatchRequest(job=self.job, directory=directory))

    def ensure_local(
        self, request: pb.EnsureLocalRequest, timeout: float
    ) -> pb.EnsureLocalResponse:
        """Bring an adopted step into the directory the request names."""
        return self.connection.ensure_local(request, timeout)

    def locate(self, step: int, timeout: float) -> pb.RestoreResponse:
        """Where this rank's part of ``step`` lies (its directory and manifest), with
        no memory leased: for reading what a step holds without restoring it."""
        req = pb.RestoreRequest(job=self.job, rank=self.rank, step=step, shared_memory=False)
        return self.connection.restore(req, timeout)

    def fetch_peers(self, step: int) -> pb.FetchPeersResponse:
        """Other nodes' parts of ``step``, fetched from the bucket into the local tier."""
        return self.connection.fetch_peers(pb.FetchPeersRequest(job=self.job, step=step))

    def open_readable(self, path: str) -> int:
        """A read-only descriptor of ``path``, a file of a restore the daemon answered."""
        return open_readable(self.connection.session, path)

    # -- memory a stager fills itself -------------------------------------------
    def lease(
        self, size_bytes: int, staging_timeout: float | None = None
    ) -> tuple[pb.Lease, mmap.mmap]:
        """A lease of at least ``size_bytes`` and its mapping (:meth:`Saver.lease`)."""
        return self._saver.lease(size_bytes, staging_timeout)

    def release(self, lease: pb.Lease) -> None:
        """Give back a lease from :meth:`lease` that will not be committed."""
        self._saver.release(lease)

    def device_copies(self) -> DeviceCopies:
        """The copier of this client's CUDA tensors into its leases (a stager that fills
        a lease itself queues its device-to-host copies there)."""
        return self._saver.device_copies()

    def copy_arrays(
        self, mm: mmap.mmap, entries: list[TensorEntry], arrays: dict[str, Any]
    ) -> None:
        """Copy arrays into their places in a leased mapping, on the client's copy threads."""
        self._saver.copy_arrays(mm, entries, arrays)

    def commit_in_place(
        self,
        step: int,
        tree: Any,
        lease: pb.Lease,
        mm: mmap.mmap,
        metadata: dict[str, Any] | None = None,
        *,
        milestone: bool = False,
        metrics: dict[str, float] | None = None,
    ) -> SaveHandle | None:
        """Hand off ``tree``, whose arrays already lie in ``mm`` (:meth:`Saver.commit_in_place`)."""
        return self._saver.commit_in_place(
            step, tree, lease, mm, metadata, milestone=milestone, metrics=metrics
        )
