"""The trainer-side client: save into shared memory, wait, restore from mmapped files."""

from __future__ import annotations

import builtins
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from ckptd.core.errors import CkptdUnavailable
from ckptd.core.wire import Connection
from ckptd.proto import ckptd_pb2 as pb

from . import restore_flow
from .ahead import warm_imports
from .goodput import Goodput
from .handle import CheckpointInfo, SaveHandle
from .handoff import Handoff
from .leaves.jax_arrays import Replicas
from .low_level import LowLevel
from .policies import FailureHistory, SaveContext, SavePolicy
from .save_args import check_metrics
from .saver import Saver

log = logging.getLogger("ckptd.client")

HISTORY_REFRESH_SECONDS = 600.0
"""Seconds between two asks for the daemon's record of the job (``Goodput()``'s
failure rates): the bucket's sample of node names is refreshed hourly."""


class Client:
    """Talks to the node's ckptd daemon over its unix socket.

    ``rank`` is this process's rank, ``node_ranks`` every rank that saves to the
    same daemon (the step commits when all of them have), ``world_size`` the
    job's total number of ranks. ``copy_threads`` (default: up to 4; the calling
    thread is one) copy the arrays into shared memory in parallel, an equal share
    of the bytes each; 1 copies on the calling thread only.
    ``policy`` decides :meth:`should_save` (default :class:`Goodput`: the interval
    that maximises expected goodput, the failure rate learned from the daemon);
    ``staging_timeout`` is how long :meth:`save` waits for staging memory held
    by earlier saves before it raises :class:`CapacityExhausted`.
    ``save_replicas``: save every replica of a replicated jax array shard, not
    only ``replica_id == 0``. ``reconnect_timeout``: while the daemon is
    unreachable (its sidecar restarting), :meth:`should_save` says False and
    :meth:`save` keeps trying this long before it raises :class:`CkptdUnavailable`.
    ``connect_timeout``: the same patience while no daemon has ever answered this
    client (no ``ckptd serve`` there, a wrong socket), so that mistake shows at once.
    ``incremental``: what did not change since the previous save is not written or
    uploaded again, and jax arrays on a TPU that are the very same objects are not
    copied again (ckptd.client.changes); off with False or ``CKPTD_INCREMENTAL=0``.
    ``trust_torch_versions``: a torch tensor whose storage and ``_version`` did not
    change is taken as unchanged, neither copied nor compared: only for programs
    that never write saved tensors behind torch's version counter (``tensor.data``,
    numpy views, BatchNorm's running statistics, collectives such as
    ``dist.broadcast``). Off (the default), the daemon compares SHA-256 digests.
    ``trust_jax_arrays``: a jax array on a CPU or GPU that is the very same object is
    taken as unchanged too, and CPU arrays are copied after :meth:`save` returns: only
    for programs whose jax arrays share no memory that anything else writes (DLPack
    to or from torch, ``jax.device_put`` / ``jnp.asarray`` of a numpy array on CPU,
    which may take its memory as it is). Off, such arrays are copied and compared.
    ``supersede``: when saves come faster than the daemon's disk writes them, a save
    whose write has not begun may be superseded by a newer one (it ends SUPERSEDED
    and never reaches the disk; the trainer does not wait for the disk). None (the
    default): only while the policy saves every step (``Continuous(stage="memory")``);
    False: every acknowledged save is written.
    """

    def __init__(
        self,
        job: str,
        socket: str | os.PathLike[str] | None = None,
        *,
        rank: int = 0,
        node_ranks: Sequence[int] | None = None,
        world_size: int | None = None,
        timeout: float = 120.0,
        copy_threads: int | None = None,
        policy: SavePolicy | None = None,
        staging_timeout: float = 60.0,
        save_replicas: Replicas = False,
        reconnect_timeout: float = 60.0,
        connect_timeout: float = 2.0,
        incremental: bool = True,
        trust_torch_versions: bool = False,
        trust_jax_arrays: bool = False,
        supersede: bool | None = None,
    ) -> None:
        if not isinstance(job, str) or not job:
            raise ValueError("job must be a non-empty string such as 'run-42'")
        if policy is not None and not isinstance(policy, SavePolicy):
            raise TypeError(f"policy must be a ckptd.client SavePolicy, not {policy!r}")
        self.job = job
        self.connection = Connection(socket, timeout)
        """The typed connection to the daemon (:class:`ckptd.core.wire.Connection`)."""
        self.socket = self.connection.socket
        self.policy: SavePolicy = policy or Goodput()
        self.last_refusal = ""
        """Why the last :meth:`should_save` said False although the policy said True."""
        self._job_history: pb.JobHistory | None = None
        self._history_at = 0.0
        self._unreachable = False
        self._handoff = Handoff(self.connection, job, reconnect_timeout, connect_timeout)
        ranks = list(node_ranks) if node_ranks is not None else [rank]
        self._saver = Saver(
            self._handoff,
            job,
            rank,
            ranks,
            world_size or max(ranks) + 1,
            copy_threads=copy_threads,
            staging_timeout=staging_timeout,
            save_replicas=save_replicas,
            watched_stage=lambda: getattr(self.policy, "stage", "local"),
            upload_interval=lambda: float(getattr(self.policy, "upload_interval_seconds", 0.0)),
            incremental=incremental,
            trust_torch_versions=trust_torch_versions,
            trust_jax_arrays=trust_jax_arrays,
        )
        self._saver.supersede = supersede
        self.low_level = LowLevel(self.connection, job, rank, self._saver)
        """What framework adapters call beyond this surface: leases they fill
        themselves, in-place commits, the daemon's status, adoption of a directory."""
        warm_imports()  # what a first save would import, on a thread (ahead.py)

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._saver.rank

    @property
    def node_ranks(self) -> list[int]:
        """Every rank that saves to this node's daemon."""
        return self._saver.node_ranks

    @node_ranks.setter
    def node_ranks(self, ranks: Sequence[int]) -> None:
        # Set after construction by adapters that ask the daemon first which ranks
        # share it (a collective needs this client): before the first save.
        self._saver.node_ranks = list(ranks)

    @property
    def world_size(self) -> int:
        """The job's total number of ranks."""
        return self._saver.world_size

    @property
    def staging_timeout(self) -> float:
        """How long :meth:`save` waits for staging memory by default, in seconds."""
        return self._saver.staging_timeout

    @staging_timeout.setter
    def staging_timeout(self, seconds: float) -> None:
        self._saver.staging_timeout = seconds

    @property
    def save_replicas(self) -> Replicas:
        """Save every replica of a replicated jax array shard, not only ``replica_id == 0``
        (``"process"``: each distinct shard once per process)."""
        return self._saver.planner.save_replicas

    @save_replicas.setter
    def save_replicas(self, on: Replicas) -> None:
        self._saver.planner.save_replicas = on

    @property
    def incremental(self) -> bool:
        """Whether saves are incremental (``incremental=``, unless ``CKPTD_INCREMENTAL=0``)."""
        return self._saver.incremental

    @property
    def timeout(self) -> float:
        """Default deadline of one RPC, in seconds."""
        return self.connection.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.connection.timeout = seconds

    # -- saving ------------------------------------------------------------------
    def save(
        self,
        step: int,
        tree: Any,
        metadata: dict[str, Any] | None = None,
        *,
        milestone: bool = False,
        metrics: dict[str, float] | None = None,
        staging_timeout: float | None = None,
    ) -> SaveHandle:
        """Hand ``tree`` to the daemon as ``step``; returns once the daemon owns the bytes.

        Arrays are copied into shared memory before this returns, so the caller
        may mutate them right after; jax arrays on an accelerator (and on CPU with
        ``trust_jax_arrays``) after it returns (``handle.wait_copied()``: see
        docs/guides/client-api.md). Wait on the handle for LOCAL / DURABLE.
        ``milestone``: the remote tier keeps this step whatever its policy.
        ``metrics``: numbers such as ``{"eval_loss": 1.7}`` for ``KeepBest``.
        If earlier saves hold all staging memory, waits up to ``staging_timeout``
        (default: the client's) and then raises :class:`CapacityExhausted`.
        """
        return self._saver.save(
            step,
            tree,
            metadata,
            milestone=milestone,
            metrics=metrics,
            staging_timeout=staging_timeout,
        )

    # -- save decisions ---------------------------------------------------------
    def _history(self) -> FailureHistory | None:
        """The daemon's record of this job's restarts, asked for once it has one and
        again every :data:`HISTORY_REFRESH_SECONDS` (the job's restarts do not change
        while this process lives; the bucket's sample of node names does); None
        while it has none. Between two asks the record's times are carried forward."""
        now = time.time()
        if self._job_history is None or now - self._history_at >= HISTORY_REFRESH_SECONDS:
            try:
                resp = self.connection.list_checkpoints(pb.ListCheckpointsRequest(job=self.job))
            except CkptdUnavailable:
                resp = None
            if resp is not None and resp.history.first_seen_unix:
                self._job_history, self._history_at = resp.history, now
            elif self._job_history is None:
                return None  # not seen yet (no save), or a daemon without the record
        seen = self._job_history
        return FailureHistory(
            max(now - seen.first_seen_unix, 0.0),
            seen.restarts,
            tuple(max(now - t, 0.0) for t in reversed(seen.restart_unix)),
            seen.fleet_observed_seconds,
            seen.fleet_restarts,
            # each node name summed ages a second a second
            seen.node_observed_seconds + seen.node_names * max(now - self._history_at, 0.0),
            seen.node_replacements,
            # Ranks not told apart by node (node_ranks unset) count as a node each:
            # more nodes, more frequent node losses, which errs towards saving often.
            max(-(-self.world_size // max(len(self.node_ranks), 1)), 1),
        )

    def reserve(self, tree: Any) -> Future[int]:
        """Have the staging memory of ``tree``'s first saves made and mapped now, on a
        thread, so the first save is as fast as later ones (call it once the state
        exists, before training). Best effort and optional: it holds nothing between
        saves, and resolves to the number of segments made ready (0: none; the saves
        then ask for their own)."""
        return self._saver.reserve(tree)

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``: the policy's answer, and room for the save.

        False while the daemon's staging memory or local disk cannot take another
        save of the previous one's size (``last_refusal`` says which), so a
        trainer that saves only when this is True never blocks in :meth:`save`.
        In a multi-process job every rank must take the same decision: decide on
        one rank and broadcast it with your framework's collectives.
        """
        last = self._saver.last
        if last is not None and int(step) == last.step:
            return False
        ctx = SaveContext(
            int(step),
            time.monotonic(),
            last.step if last else None,
            self._saver.last_at,
            self._saver.previous_reached,
            self._history,
            self._saver.previous_uploaded,
        )
        if not self.policy.should_save(ctx):
            return False
        self.last_refusal = ""
        if self._saver.last_bytes:
            try:
                cap = self.connection.check_capacity(
                    pb.CheckCapacityRequest(job=self.job, size_bytes=self._saver.last_bytes),
                )
            except CkptdUnavailable as exc:
                # The sidecar is restarting: skip this save, never stop training.
                self.last_refusal = f"the ckptd daemon is unreachable: {exc}"
                if not self._unreachable:
                    log.warning("step %d: not saving while %s", step, self.last_refusal)
                self._unreachable = True
                return False
            self._unreachable = False
            if not cap.ok:
                self.last_refusal = cap.reason
                log.debug("step %d: not saving now: %s", step, cap.reason)
                return False
        return True

    def pin(self, step: int, pinned: bool = True) -> None:
        """Pin a step: no tier evicts it until :meth:`unpin` (``ckptd pin`` does the same)."""
        self.connection.pin(pb.PinRequest(job=self.job, step=int(step), pinned=pinned))

    def unpin(self, step: int) -> None:
        """Undo :meth:`pin`; the retention policies decide again."""
        self.pin(step, pinned=False)

    def set_retention(self, policy: str | None) -> tuple[str, str]:
        """Make ``policy`` (the config's language: ``KeepLatest(5)``, ``KeepBest('loss',
        2)``, a list of them) this job's retention in every tier, in place of the
        node's, within the operator's limits; None gives the node's back. Returns what
        the local and the remote tier now keep (docs/operating/retention.md)."""
        req = pb.SetRetentionRequest(job=self.job, policy=policy or "")
        resp = self.connection.set_retention(req)
        return resp.local, resp.remote

    def adopt(
        self,
        step: int,
        path: str | os.PathLike[str],
        *,
        milestone: bool = False,
        metrics: dict[str, float] | None = None,
    ) -> SaveHandle:
        """Hand a finished checkpoint directory another framework wrote (DCP's
        FileSystemWriter, Megatron, HF, an Orbax step) to the daemon as ``step``.

        It is hard-linked into the local tier (copied if on another filesystem),
        LOCAL when this returns, then drained byte-identical to
        ``<remote>/<job>/<step>/``. Do not modify the directory afterwards.
        """
        req = pb.AdoptRequest(
            job=self.job,
            step=int(step),
            path=os.path.abspath(path),
            milestone=milestone,
            metrics=check_metrics(metrics),
        )
        self.connection.adopt(req, max(self.timeout, 600.0))
        return SaveHandle(self, int(step))

    # -- public API ------------------------------------------------------------
    def restore(
        self,
        step: int | None = None,
        *,
        target: Any = None,
        shared_memory: bool = True,
        rank: int | None = None,
        healthy: bool = False,
    ) -> tuple[Any, dict[str, Any]]:
        """Restore the newest restorable step (or ``step``): ``(tree, metadata)``.

        Every shard is checked against its crc32c before you see it; a corrupt
        copy is set aside by the daemon and the next newest intact step is
        returned instead (``restore(step=N)`` raises ``CheckpointCorrupt``).
        Arrays are views, never copies: over a shared-memory segment the daemon
        filled with ``O_DIRECT`` reads and hands to this process, or, with
        ``shared_memory=False`` or when the daemon has no free segment, over the
        shard file mapped copy-on-write. Either way they are writable and
        writing never touches the checkpoint.

        Saved ``jax.Array`` leaves come back as numpy arrays of their global
        shape, or, with ``target`` (the tree's structure with
        ``jax.ShapeDtypeStruct`` leaves carrying a sharding, or arrays whose
        sharding to copy), as jax arrays on that sharding: each device's slice is
        assembled from the saved shards that overlap it, so another mesh,
        sharding or device count works.

        ``rank``: another rank's part of the step on this node (default: this
        client's rank); DCP's reader reads every saving rank's items this way.

        ``healthy=True``: only a step known to hold no NaN or Inf (the daemon counts
        them in every floating shard as it saves; ``CheckpointInfo.healthy``): the
        newest such step, the "last known good" after a divergence. Steps saved by a
        ckptd that did not count them are not known healthy.

        A process's first restore of its own rank, before it saves, also has its first
        saves' staging memory made ready on a thread, of the restored step's size (as
        :meth:`reserve` does): a restarted trainer's first saves are as fast as later
        ones. It uses only free room and holds nothing between saves.
        """
        # A restarting daemon is waited for (reconnect_timeout), like a save. A
        # restore of this rank tells its size: the first saves' memory made ahead.
        own = rank is None or rank == self.rank
        ahead = self._saver.ahead.restored if own else None
        return self._handoff.retrying(
            f"job {self.job!r} was not restored",
            lambda: restore_flow.restore(
                self.connection,
                self.job,
                self.rank if rank is None else rank,
                step,
                target,
                shared_memory,
                self._handoff.liveness.metadata(),
                healthy,
                ahead,
            ),
        )

    def list(self) -> list[CheckpointInfo]:
        """This job's checkpoints on this node, newest first."""
        resp = self.connection.list_checkpoints(pb.ListCheckpointsRequest(job=self.job))
        return [CheckpointInfo.of(c) for c in resp.checkpoints]

    def all_steps(self, healthy: bool = False) -> builtins.list[int]:
        """Steps of the job's live history with a complete copy in some tier (this
        node's, or the bucket's), oldest first: what :meth:`restore` can be asked for
        (Orbax's ``all_steps``; steps a later timeline abandoned are left out);
        ``healthy``: only those known to hold no NaN/Inf."""
        return sorted(
            c.step
            for c in self.list()
            if c.tiers and not c.adopted and not c.abandoned and (c.healthy or not healthy)
        )

    def latest_step(self, healthy: bool = False) -> int | None:
        """The newest step :meth:`restore` would return, None if there is none yet
        (Orbax's ``latest_step``; ``healthy``: as ``restore(healthy=True)`` would). In
        a multi-process job every process must restore the same step: agree on one
        with ``ckptd.client.distributed``."""
        steps = self.all_steps(healthy)
        return steps[-1] if steps else None

    def wait_until_finished(self, stage: str = "local", timeout: float | None = None) -> None:
        """Block until the last :meth:`save` reached ``stage`` (``"local"``: restorable
        on this node; ``"durable"``: in the bucket too), raising :class:`SaveFailed` if
        it failed (Orbax's ``wait_until_finished``). Returns at once with no save."""
        if self._saver.last is not None:
            self._saver.last.wait(stage, timeout=timeout)

    def close(self) -> None:
        """Close the channel and unmap shared memory."""
        self._saver.close()
        self._handoff.close()
        self.connection.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CheckpointInfo", "Client", "SaveHandle"]
