"""The save path of :class:`ckptd.client.Client` (split out of client.py): plan, lease,
copy, hand off; and a lease a stager fills itself, handed off as it lies."""

from __future__ import annotations

import json
import mmap
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ckptd.core.errors import CapacityExhausted, SaveFailed
from ckptd.core.format import TensorEntry, round_up
from ckptd.core.health import RESERVED_PREFIX
from ckptd.core.wire import Connection
from ckptd.proto import ckptd_pb2 as pb

from .copying import copy_into
from .handle import SaveHandle
from .handoff import Handoff
from .jax_arrays import ShardPlan
from .planning import Planner, SavePlan, plan_in_place


class Saving:
    """Client's saves. The attributes are the client's (set in ``Client.__init__``)."""

    job: str
    rank: int
    node_ranks: list[int]
    world_size: int
    staging_timeout: float
    policy: Any
    _planner: Planner
    _handoff: Handoff
    _background: ThreadPoolExecutor
    _copy_job: Future[None] | None
    _last: SaveHandle | None
    _last_at: float | None
    _last_bytes: int
    _last_reached: set[str]
    _watch: dict[str, threading.Event]

    _copier: ThreadPoolExecutor | None
    connection: Connection
    _previous_reached: Callable[[str], bool]
    """Client's: has the previous save reached a stage (for should_save)."""

    def _copy_into(self, mm: mmap.mmap, entries: list[TensorEntry], arrays: dict[str, Any]) -> None:
        """Copy every array into its place in the lease (:func:`copy_into`)."""
        copy_into(mm, entries, arrays, self._copier)

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
        may mutate them right after. Wait on the handle for LOCAL / DURABLE.
        ``milestone``: the remote tier keeps this step whatever its policy.
        ``metrics``: numbers such as ``{"eval_loss": 1.7}`` for ``KeepBest``.
        If earlier saves hold all staging memory, waits up to ``staging_timeout``
        (default: the client's) and then raises :class:`CapacityExhausted`.
        """
        step, metrics, metadata_json = _save_args(step, metrics, metadata)
        wait = self.staging_timeout if staging_timeout is None else staging_timeout
        plan, arrays = self._planner.plan(tree)
        host, device, data_len = arrays.host, arrays.device, plan.data_len
        started = time.monotonic()
        what = f"step {step} of job {self.job!r} was not saved"
        self._finish_copy()  # one background copy at a time: it may use a mapped segment
        try:
            lease, mm = self._handoff.acquire(round_up(data_len), wait, what)
        except CapacityExhausted as exc:
            raise CapacityExhausted(f"{what}: {exc}", exc.code) from None
        committed = False
        req = pb.CommitShardsRequest(lease_id=lease.lease_id)
        try:
            self._copy_into(mm, plan.host_entries, host)
            req = self._commit_request(req.lease_id, step, plan, metadata_json, milestone, metrics)
            if device:
                # jax arrays are immutable: copy them to host and hand off after returning.
                # Every device-to-host transfer starts now, at once (on an accelerator they
                # overlap; one by one, each waited for its own): the copies find them done.
                for sp in device.values():
                    sp.data.copy_to_host_async()
                self._copy_job = self._background.submit(
                    self._copy_device_and_commit,
                    mm,
                    plan.device_entries,
                    device,
                    req,
                    round_up(data_len),
                )
            else:
                self._handoff.commit(req, mm, round_up(data_len), what)
            committed = True
        finally:
            if not committed:
                self._handoff.release(req.lease_id)  # the lease of the last attempt
        handle = SaveHandle(self, step, self._copy_job if device else None)
        return self._saved(handle, started, round_up(data_len))

    def _commit_request(
        self,
        lease_id: str,
        step: int,
        plan: SavePlan,
        metadata_json: str,
        milestone: bool,
        metrics: dict[str, float],
    ) -> pb.CommitShardsRequest:
        return pb.CommitShardsRequest(
            lease_id=lease_id,
            job=self.job,
            step=step,
            rank=self.rank,
            node_ranks=self.node_ranks,
            world_size=self.world_size,
            data_offset=0,
            table=plan.table,
            tree_json=plan.tree_json,
            metadata_json=metadata_json,
            milestone=milestone,
            metrics=metrics,
        )

    def _saved(self, handle: SaveHandle, started: float, size: int) -> SaveHandle:
        """Bookkeeping after a handoff: the last save, for should_save()."""
        self._last, self._last_at, self._last_bytes = handle, started, size
        self._last_reached, self._watch = set(), {}
        # Start watching now, so a save that reaches the stage before the next
        # should_save() is seen there at once.
        self._previous_reached(getattr(self.policy, "stage", "local"))
        return handle

    # -- saving memory a stager filled itself -----------------------------------
    def lease(self, size_bytes: int, staging_timeout: float | None = None) -> tuple[Any, mmap.mmap]:
        """A lease of at least ``size_bytes`` and its mapping, for a stager that copies
        a state into it itself (DCP's ``async_save`` through ckptd) and then hands it
        off with :meth:`commit_in_place` or gives it back with :meth:`release`."""
        wait = self.staging_timeout if staging_timeout is None else staging_timeout
        what = f"no shared memory for a save of job {self.job!r}"
        return self._handoff.acquire(round_up(max(1, size_bytes)), wait, what)

    def release(self, lease: Any) -> None:
        """Give back a lease from :meth:`lease` that will not be committed."""
        self._handoff.release(lease.lease_id)

    def commit_in_place(
        self,
        step: int,
        tree: Any,
        lease: Any,
        mm: mmap.mmap,
        metadata: dict[str, Any] | None = None,
        *,
        milestone: bool = False,
        metrics: dict[str, float] | None = None,
    ) -> SaveHandle | None:
        """Hand off ``tree`` as ``step`` with no copy: its array leaves are views of
        ``mm`` (the mapping of ``lease``) lying back to back from its start. Returns
        None, committing nothing (the lease is still held), if they do not lie so."""
        step, metrics, metadata_json = _save_args(step, metrics, metadata)
        plan = plan_in_place(tree, mm)
        if plan is None:
            return None
        started = time.monotonic()
        req = self._commit_request(lease.lease_id, step, plan, metadata_json, milestone, metrics)
        self._handoff.commit(req, mm, len(mm), f"step {step} of job {self.job!r} was not saved")
        return self._saved(SaveHandle(self, step), started, round_up(plan.data_len))

    def _copy_device_and_commit(
        self,
        mm: mmap.mmap,
        entries: list[TensorEntry],
        device: dict[str, ShardPlan],
        req: Any,
        size: int,
    ) -> None:
        """Background: device-to-host copies into the lease, then the handoff."""
        what = f"step {req.step} of job {self.job!r} was not saved"
        try:
            for e in entries:
                try:
                    host = np.asarray(device[e.key].data)
                except RuntimeError as exc:
                    if "deleted" not in str(exc):
                        raise
                    # jax deletes a donated array's buffer whatever refers to it.
                    raise SaveFailed(
                        f"{what}: {e.key!r} was deleted before ckptd copied it to host "
                        "(donated to a jitted step: donate_argnums/donate_argnames). Call "
                        "handle.wait_copied() before the step that donates the saved "
                        "state, or use ckptd.client.orbax.CheckpointManager, whose save() "
                        "returns once the arrays may be donated"
                    ) from None
                self._copy_into(mm, [e], {e.key: host})
            self._handoff.commit(req, mm, size, what)
        except BaseException:
            self._handoff.release(req.lease_id)
            raise

    def _finish_copy(self) -> None:
        if self._copy_job is not None:
            self._copy_job.exception()  # wait; its handle reports any error
            self._copy_job = None


def _save_args(
    step: Any, metrics: dict[str, float] | None, metadata: dict[str, Any] | None
) -> tuple[int, dict[str, float], str]:
    """A save's step, metrics and metadata (as JSON), checked."""
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(f"step must be a non-negative int, not {step!r}")
    if metadata is not None and not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict, not {type(metadata).__name__}")
    try:
        metadata_json = json.dumps(metadata or {})
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata must be a JSON-serialisable dict: {exc}") from None
    return int(step), _check_metrics(metrics), metadata_json


def _check_metrics(metrics: dict[str, float] | None) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise TypeError(f"metrics must be a dict of name -> number, not {type(metrics).__name__}")
    out = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or isinstance(value, bool):
            raise TypeError(f"metric {name!r}: names must be str and values numbers")
        if name.startswith(RESERVED_PREFIX):
            raise ValueError(
                f"metric {name!r}: names starting with {RESERVED_PREFIX!r} are set by the "
                "daemon (ckptd.nonfinite: the step's NaN/Inf count); rename it"
            )
        try:
            out[name] = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"metric {name!r} = {value!r} is not a number") from None
    return out
