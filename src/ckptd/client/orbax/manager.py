"""``ocp.CheckpointManager`` (Orbax's v0 API) saving through ckptd's shared memory.

Construct it as Orbax's (MaxText's ``create_orbax_checkpoint_manager`` does, through
:func:`ckptd.client.orbax.use_in_maxtext`); ``save`` copies each process's
addressable shards into its node daemon's shared memory and returns, the daemon
writes the step to its local tier and drains it to the bucket. What maps to what
(docs/integrations/maxtext.md):

- ``save(step, args=ocp.args.Composite(...))`` of ``StandardSave`` / ``PyTreeSave`` /
  ``JsonSave`` items, honouring the save decision policy (``save_interval_steps``,
  ``save_on_steps``, ``should_save_fn`` or ``save_decision_policy``: Orbax's own
  policy objects decide, fed ckptd's state). ``save`` returns once the trainer may
  donate the arrays (client/orbax/save.py); the write runs on.
- ``wait_until_finished``: the last save is LOCAL (on the node's disk), or
  DURABLE (in the bucket) if it was saved at a preemption.
- ``restore`` with ``StandardRestore`` / ``PyTreeRestore`` (``restore_args`` with a
  sharding, ``partial_restore``) / ``JsonRestore``: each process reads what it
  needs from its node's copy (or the bucket); ``latest_step`` / ``all_steps`` are
  the steps every process can restore, agreed when the manager is created.
- ``max_to_keep``, ``keep_period``, ``best_fn``/``best_mode`` and preservation
  policies become the job's ckptd retention in every tier (retention.py), within
  the operator's limits; ``all_steps`` lists the steps that still exist,
  ``best_step`` ranks them by ``best_fn``, ``metrics(step)`` gives a step's metrics.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from jax.experimental import multihost_utils

from ckptd.core.errors import FailedPrecondition, InvalidArgument

from ..client import Client
from ..leaves.jax_arrays import Replicas
from . import hosts
from . import items as items_lib
from . import save as decide
from .retention import Retention

log = logging.getLogger("ckptd.client.orbax")
ocp = items_lib.ocp
StepAlreadyExistsError: type[Exception] = getattr(
    ocp.checkpoint_manager, "StepAlreadyExistsError", ValueError
)
"""Orbax's own error for a step saved twice, so code catching it keeps working."""


def job_for(directory: str | os.PathLike[str] | None) -> str:
    """The ckptd job of an Orbax directory: its last component, or the one above when
    that is ``checkpoints`` (MaxText's ``<output>/<run_name>/checkpoints/``)."""
    parts = [p for p in str(directory or "").rstrip("/").split("/") if p]
    if parts and parts[-1] == "checkpoints" and len(parts) > 1:
        parts.pop()
    if not parts or parts[-1] in (".", ".."):
        raise InvalidArgument(
            f"no ckptd job name in directory {directory!r}: pass job='run-42' to the "
            "CheckpointManager (or use_in_maxtext(job=...))"
        )
    return parts[-1]


class CheckpointManager:
    """Orbax's ``CheckpointManager`` API over the node's ckptd daemon.

    Takes Orbax's arguments (``directory``, ``options``, ``item_names``,
    ``item_handlers``, ...: handlers and loggers are accepted and unused) and:
    ``job`` (default: from ``directory``, see :func:`job_for`), ``socket`` (the
    daemon's; default ``$CKPTD_SOCKET`` or ckptd's), or a ready ``client``.
    ``blocking_host_copy``: ``save`` returns once the trainer may donate its arrays
    (Orbax's own contract; MaxText's train step does): on an accelerator once each
    is on its way to pinned host memory, on CPU once copied into shared memory.
    False copies them after ``save`` returned, for trainers that never donate.
    ``replicas``: which shards each process saves
    (:data:`~ckptd.client.leaves.jax_arrays.Replicas`);
    by default each distinct shard it holds, so every node restores from its own
    disk what its devices need (arrays replicated across processes, such as the
    step, are stored once per process); False: replica 0 only, as Orbax (the other
    nodes then read those shards from the bucket when restoring).

    In a multi-process jax job every process creates one (a collective: it finds
    which processes share a daemon and agrees on the restorable steps).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        checkpointers: Any = None,
        options: Any = None,
        metadata: dict[str, Any] | None = None,
        item_names: Any = None,
        item_handlers: Any = None,
        logger: Any = None,
        handler_registry: Any = None,
        *,
        job: str | None = None,
        socket: str | os.PathLike[str] | None = None,
        client: Client | None = None,
        blocking_host_copy: bool = True,
        replicas: Replicas = "process",
    ) -> None:
        del checkpointers, logger, handler_registry  # Orbax's writers: not used here
        self._options = options if options is not None else ocp.CheckpointManagerOptions()
        self._directory = directory
        self._root_metadata = dict(metadata or {})
        self._default_item: bool | None = _default_item_mode(item_names, item_handlers)
        self._policy = decide.decision_policy(self._options)
        self._blocking_copy = blocking_host_copy
        self._owns_client = client is None
        if client is None:
            rank, count = hosts.process()
            client = Client(
                job or job_for(directory),
                socket,
                rank=rank,
                world_size=count,
                save_replicas=replicas,
                supersede=False,  # Orbax lists every step it saved: each is written
            )
            client.node_ranks = hosts.node_ranks(client)
        self.client = client
        """The ckptd client every save and restore goes through."""
        self._remote = hosts.has_remote(client)
        self._waiter = ThreadPoolExecutor(1, "ckptd-orbax-wait")
        self._pending: Future[None] | None = None
        self._pending_step: int | None = None
        self._infos: list[decide.StepInfo] = []
        self._retention = Retention(self._options)
        if not self._options.read_only:  # None too: an earlier run's policy must not stay
            try:
                client.set_retention(self._retention.text)
            except FailedPrecondition as exc:  # the operator keeps every job's retention
                log.warning("job %s: %s", client.job, exc)
        self.reload()

    # -- what Orbax's manager tells about its steps ---------------------------
    @property
    def directory(self) -> Any:
        """The directory given (an ``epath.Path``); ckptd does not write there."""
        import importlib

        epath = importlib.import_module("etils.epath")  # Orbax's path type (gs:// too)
        return epath.Path(self._directory if self._directory is not None else self.client.job)

    def reload(self) -> None:
        """Ask the daemons again which steps every process can restore (a collective)."""
        steps = hosts.agreed_steps(self.client)
        times = hosts.step_times(self.client, steps)
        self._infos = [
            decide.StepInfo(s, datetime.datetime.fromtimestamp(times.get(s, 0.0), tz=datetime.UTC))
            for s in steps
        ]

    def all_steps(self, read: bool = False) -> list[int]:
        """The job's steps, oldest first: saved by this manager, or restorable by
        every process when it was created (``read=True``: :meth:`reload` first),
        that retention has not removed since."""
        if read:
            self.reload()
        self._forget_removed()
        return [i.step for i in self._infos]

    def _forget_removed(self) -> None:
        """Drop the steps retention removed: no tier of this node holds them, or one
        holds them only while a kept step reads their data (an incremental save's
        unchanged shards) or a reader has them open. The save in flight stays."""
        if not self._infos:
            return
        held = set()
        for c in self.client.list():
            reasons = (*c.local_reasons, *c.remote_reasons)
            # No reason at all: held elsewhere (other nodes' parts, a peer), not planned here.
            if c.state == "STAGING" or (c.tiers and not (reasons and all(map(_holder, reasons)))):
                held.add(c.step)
        keep = held | {self._pending_step}
        self._infos = [i for i in self._infos if i.step in keep]

    def latest_step(self) -> int | None:
        """The newest of :meth:`all_steps`, None if there is none."""
        return self._infos[-1].step if self._infos else None

    def best_step(self) -> int | None:
        """The step ``best_fn`` ranks best (by ``best_mode``) among :meth:`all_steps`,
        None if none has metrics; without ``best_fn`` the newest, as Orbax's."""
        steps = self.all_steps()
        if self._retention.best is None:
            return steps[-1] if steps else None
        name, mode = self._retention.best
        rows = self.client.list()
        scored = {c.step: c.metrics[name] for c in rows if c.metrics and name in c.metrics}
        ranked = [(scored[s], s) for s in steps if s in scored]
        if not ranked:
            return None
        return (min if mode == "min" else max)(ranked)[1]

    def metrics(self, step: int) -> Any:
        """The metrics saved with ``step`` (None if it was saved without)."""
        return self._saved(int(step)).metrics or None

    def reached_preemption(self, step: int) -> bool:
        """Whether jax's preemption sync point is reached at ``step`` (every process
        answers the same; False without ``jax.distributed``)."""
        try:
            return bool(multihost_utils.reached_preemption_sync_point(step))
        except RuntimeError:  # the preemption service is off
            return False

    def is_saving_in_progress(self) -> bool:
        """Whether the last save has not yet reached the node's disk (LOCAL)."""
        return self._pending is not None and not self._pending.done()

    def should_save(self, step: int) -> bool:
        """Orbax's decision for ``step``: after the newest step, and the save decision
        policy says so (Orbax's policy objects, fed ckptd's state)."""
        if self._options.read_only:
            return False
        latest = self.latest_step()
        if latest is not None and latest >= step:
            return False
        check = getattr(self._options, "enable_should_save_is_saving_in_progress_check", True)
        saving = check and self.is_saving_in_progress()
        context = decide.decision_context(saving, self.reached_preemption(step), self._options)
        now = decide.StepInfo(int(step), decide.now())
        return bool(self._policy.should_save(now, previous_steps=self._infos, context=context))

    # -- save ------------------------------------------------------------------
    def save(
        self,
        step: int,
        items: Any = None,
        save_kwargs: Any = None,
        metrics: dict[str, Any] | None = None,
        force: bool | None = False,
        args: Any = None,
        custom_metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Save ``args`` as ``step`` if :meth:`should_save` (or ``force``); True if saved.

        Returns once every array is in the daemon's shared memory; the step then
        becomes LOCAL and DURABLE in the background (:meth:`wait_until_finished`).
        """
        if items is not None or save_kwargs is not None:
            raise InvalidArgument(
                "items= / save_kwargs= (Orbax's deprecated API) are not supported: pass "
                "args=ocp.args.Composite(...)"
            )
        if args is None:
            raise InvalidArgument("Must provide `args` for `save`.")
        if self._default_item is None:
            self._default_item = not isinstance(args, ocp.args.Composite)
        named = items_lib.items_of(args, self._default_item)
        if not force and not self.should_save(step):
            return False
        if self._options.read_only:
            log.warning("job %s is read only: step %d not saved", self.client.job, step)
            return False
        if step in self.all_steps():
            raise StepAlreadyExistsError(f"Checkpoint for step {step} already exists.")
        self.check_for_errors()
        preempted = self.reached_preemption(step)
        tree, meta = items_lib.to_save(named, self._default_item, custom_metadata, metrics)
        # The trainer may donate its arrays once save() returns: on an accelerator they
        # are on their way to pinned host memory by then; on CPU, copied.
        snapshot = decide.off_device(tree) if self._blocking_copy else None
        numbers = {**(items_lib.numeric_metrics(metrics) or {}), **self._retention.scores(metrics)}
        handle = self.client.save(
            int(step), tree if snapshot is None else snapshot, meta, metrics=numbers or None
        )
        if self._blocking_copy and snapshot is None:
            handle.wait_copied()
        # A preemption's save must outlive the node: wait for the bucket (if any).
        stage = "durable" if preempted and self._remote else "local"
        self._pending, self._pending_step = self._waiter.submit(handle.wait, stage), int(step)
        # A step below the newest starts a new timeline: the ones above are abandoned.
        self._infos = [i for i in self._infos if i.step < step]
        self._infos.append(decide.StepInfo(int(step), decide.now(), metrics))
        if not self._options.enable_async_checkpointing:
            self.wait_until_finished()
        return True

    def wait_until_finished(self) -> None:
        """Block until the last save is LOCAL (DURABLE if saved at a preemption);
        raises :class:`ckptd.core.errors.SaveFailed` if it failed."""
        pending, step = self._pending, self._pending_step
        if pending is None:
            return
        try:
            pending.result()
        except BaseException:
            self._infos = [i for i in self._infos if i.step != step]
            self._pending = None
            raise

    def check_for_errors(self) -> None:
        """Raise the last save's error if it has failed (never blocks)."""
        if self._pending is not None and self._pending.done():
            self.wait_until_finished()

    # -- restore -----------------------------------------------------------------
    def restore(
        self,
        step: int | None,
        items: Any = None,
        restore_kwargs: Any = None,
        directory: Any = None,
        args: Any = None,
    ) -> Any:
        """Restore ``step`` (None: :meth:`latest_step`): the items ``args`` names, as
        an ``ocp.args.Composite`` (the one item for a manager without item names)."""
        if items is not None or restore_kwargs is not None or directory is not None:
            raise InvalidArgument(
                "items= / restore_kwargs= / directory= are not supported by ckptd's "
                "CheckpointManager: pass args=ocp.args.Composite(...)"
            )
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"No steps found for ckptd job {self.client.job!r}.")
        saved = self._saved(int(step))
        if self._default_item is None:
            self._default_item = saved.default_item
        asked = None if args is None else items_lib.items_of(args, saved.default_item)
        plan = items_lib.plan_restore(asked, saved)
        tree, _ = self.client.restore(step=saved.step, target=plan.target)
        out = items_lib.finish_restore(tree, plan, saved)
        self._rolled_back_to(saved.step)
        if saved.default_item:
            return out[items_lib.DEFAULT_ITEM]
        return ocp.args.Composite(**out)

    def _rolled_back_to(self, step: int) -> None:
        """Training goes on from ``step``: a restore below the newest step is a rollback.
        Steps above it are left out of ``all_steps`` (Orbax's ``should_save`` would
        refuse every step up to the newest, silently); the daemon marks them abandoned
        when the next save starts a new timeline (docs/reliability.md, Timelines)."""
        above = [i.step for i in self._infos if i.step > step]
        if above:
            log.info(
                "job %s: restored step %d below the newest (%d): saves from here start a "
                "new timeline; steps %s are left behind",
                self.client.job,
                step,
                above[-1],
                above,
            )
            self._infos = [i for i in self._infos if i.step <= step]

    def _saved(self, step: int) -> items_lib.SavedStep:
        """What the step's manifest says about its items (no array is read)."""
        if step == self._pending_step:
            self.wait_until_finished()  # this manager's own save, still being written
        resp = self.client.low_level.locate(step, max(self.client.timeout, 600.0))
        return items_lib.SavedStep.of(
            int(resp.step), json.loads(resp.manifest_json), self.client.rank
        )

    def item_metadata(self, step: int) -> Any:
        """``metadata(step).item_metadata``."""
        return self.metadata(step).item_metadata

    def metadata(self, step: int | None = None) -> Any:
        """Orbax's ``StepMetadata`` of ``step`` (item metadata: trees of
        ``jax.ShapeDtypeStruct``, JSON items as saved; ``custom_metadata``; metrics),
        or without a step the ``RootMetadata`` given to the constructor."""
        ocp_metadata = ocp.metadata
        if step is None:
            return ocp_metadata.RootMetadata(custom_metadata=dict(self._root_metadata))
        saved = self._saved(int(step))
        per_item = items_lib.item_metadata(saved)
        item_meta = (
            per_item[items_lib.DEFAULT_ITEM]
            if saved.default_item
            else ocp.args.Composite(**per_item)
        )
        return ocp_metadata.StepMetadata(
            item_metadata=item_meta,
            metrics=dict(saved.metrics),
            custom_metadata=dict(saved.custom_metadata),
        )

    def close(self) -> None:
        """Wait for the last save (:meth:`wait_until_finished`), then close the client
        if this manager made it."""
        try:
            self.wait_until_finished()
        finally:
            self._waiter.shutdown(wait=True)
            if self._owns_client:
                self.client.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ckptd.client.orbax.CheckpointManager(job={self.client.job!r})"


def _holder(reason: str) -> bool:
    """A reason a tier keeps a step that is not the job's retention: a kept step reads
    its data, or a reader has it open; it goes once neither holds."""
    return reason == "in-use" or reason.startswith("referenced-by-")


def _default_item_mode(item_names: Any, item_handlers: Any) -> bool | None:
    """Orbax's rule: named items with ``item_names`` or a dict of handlers, one unnamed
    item with a single handler; None: decided by the first save's args."""
    if item_names:
        return False
    if item_handlers is not None:
        return not isinstance(item_handlers, dict)
    return None


__all__ = ["CheckpointManager", "StepAlreadyExistsError", "job_for"]
