"""What ckptd's Lightning classes do, apart from the Lightning classes they subclass
(``lightning`` or ``pytorch_lightning``): save a checkpoint dict as a ckptd step,
load one back, map Lightning's file names to steps and keep its choices pinned.

- **Steps.** A checkpoint is saved as step ``checkpoint["global_step"]``. Lightning
  saves one global step under several names (``ModelCheckpoint(save_last=True)``
  saves the top-k file and ``last.ckpt``; an epoch end right after a step's save);
  the daemon is handed each step once, and the later names refer to the same
  step (its first save's contents). A step restored from is not saved again either.
- **Names.** Every name a step was saved under, as Lightning passed it, maps to the
  step; the map is recorded in each save's metadata and read back with the step
  restored, so ``best_model_path`` and top-k removal work after a restart. The
  name a ``ModelCheckpoint`` calls its last checkpoint names the restored step.
- **Pins.** A step is pinned (no tier evicts it) while one of Lightning's names
  refers to it; when ``remove_checkpoint`` drops its last name, or a name moves to a
  newer step (``last.ckpt``), it is unpinned and ckptd's retention decides. Steps
  saved here carry the metric ``lightning`` = 1, so a resumed run can tell its own
  pins (it re-pins what the restored step's names refer to, and unpins the rest).
- **Ranks.** Lightning calls ``CheckpointIO.save_checkpoint`` on global rank 0
  only (DDP's state is the same on every rank); that process saves as ckptd rank 0
  of a one-rank step. Every rank loads that rank's part, after agreeing on the step
  over ``torch.distributed`` (:func:`ckptd.client.distributed.agree_on_step`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckptd.core.errors import (
    CheckpointNotFound,
    CkptdError,
    FailedPrecondition,
    InvalidArgument,
)

from ..client import Client
from ..handle import SaveHandle
from ..torch.codec import FORMAT, MapLocation, decode, encode
from .pins import Settle, names_after_restore, reconcile_pins

log = logging.getLogger("ckptd.lightning")

SCHEME = "ckptd://"
LATEST = "latest"
METRIC = "lightning"
"""Metric (value 1) on every step this integration saved: its pins are this integration's."""
IN_FLIGHT_TIMEOUT = 300.0
"""Longest wait for an acknowledged step still being written before choosing "latest"."""

STORES: weakref.WeakValueDictionary[str, CheckpointStore] = weakref.WeakValueDictionary()
"""The store of each job in this process (the ``ckptd://`` filesystem asks it for names)."""


def split_url(path: str) -> tuple[str, str] | None:
    """``(job, rest)`` of ``ckptd://<job>/<rest>``; None for any other path."""
    if not path.startswith(SCHEME):
        return None
    job, _, rest = path[len(SCHEME) :].partition("/")
    return job, rest.strip("/")


def global_rank() -> int:
    """This process's rank in torch.distributed's default group (0 without one)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def _world_size() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


class CheckpointStore:
    """One job's checkpoints as Lightning sees them (see the module docstring).

    ``wait_local``: :meth:`save` returns once the step is LOCAL (on this node's
    disk, like a file ``TorchCheckpointIO`` wrote); otherwise once the daemon owns
    the bytes (the daemon writes them in the background; a failure is raised by
    the next save or by :meth:`finish`).
    """

    def __init__(
        self, job: str, socket: str | os.PathLike[str] | None, wait_local: bool, options: Any
    ) -> None:
        if not isinstance(job, str) or not job or "/" in job:
            raise InvalidArgument(f"job must be a ckptd job name such as 'run-42', not {job!r}")
        self.job = job
        self.socket = None if socket is None else os.fspath(socket)
        self.wait_local = wait_local
        self.options = dict(options)
        self.names: dict[str, int] = {}
        """Lightning's name -> step, for every name Lightning still refers to."""
        self._handed: set[int] = set()  # steps saved or restored: never handed again
        self._pinned: set[int] = set()  # steps this store pinned (or asked to)
        self._loaded = False
        self._warned = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._pid = 0
        self._worker: ThreadPoolExecutor | None = None
        self._last: Future[None] | None = None
        self._policies: dict[int, str] = {}  # what each CkptdModelCheckpoint keeps
        self.pending_metrics: dict[str, float] = {}
        """Numbers for the next save (a ``CkptdModelCheckpoint``'s monitored value)."""
        STORES[job] = self

    @property
    def url(self) -> str:
        """``ckptd://<job>``: ``CkptdModelCheckpoint``'s default ``dirpath``."""
        return f"{SCHEME}{self.job}"

    @property
    def client(self) -> Client:
        """This process's client (made on first use: a Lightning launcher may fork or
        spawn the processes after this object was made)."""
        if self._client is None or self._pid != os.getpid():
            # Every checkpoint Lightning names is written (supersede=False).
            opts = {"rank": 0, "node_ranks": [0], "world_size": 1, "supersede": False,
                    **self.options}  # fmt: skip
            self._client, self._pid = Client(self.job, self.socket, **opts), os.getpid()
            self._worker, self._last = None, None
        return self._client

    # -- save -----------------------------------------------------------------------
    def save(self, checkpoint: dict[str, Any], path: Any, storage_options: Any) -> None:
        """Hand ``checkpoint`` to the daemon as its global step, named ``path``."""
        self._raise_error()
        milestone, metrics = _storage_options(storage_options)
        name = self._name(path)
        if global_rank() != 0:
            raise InvalidArgument(
                f"CheckpointIO.save_checkpoint was called on rank {global_rank()}: ckptd's "
                "Lightning integration saves what global rank 0 is given (DDP and every "
                "Lightning strategy that saves through a CheckpointIO); save sharded "
                "state with torch.distributed.checkpoint and ckptd.client.torch.CkptdWriter"
            )
        step = _global_step(checkpoint)
        if step in self._handed:  # the same step under another name: no second save
            self._settle(None, None, self._point(name, step))
            return
        self._start_fresh(step)
        tree, replace = encode(checkpoint)
        meta = {
            "format": FORMAT,
            "step": step,
            "names": {**self.names, name: step},
            "replace": replace,
            "epoch": checkpoint.get("epoch"),
            "version": checkpoint.get("pytorch-lightning_version"),
        }
        handle = self.client.save(
            step,
            tree,
            {"lightning": meta},
            milestone=milestone,
            metrics={METRIC: 1.0, **self.pending_metrics, **metrics},
        )
        self.pending_metrics = {}
        self._handed.add(step)
        self._settle(handle, step, self._point(name, step))

    def keep(self, owner: object, policy: str) -> None:
        """``owner`` (a ``CkptdModelCheckpoint``) keeps what ``policy`` keeps: the job's
        retention in every tier is what any of them keeps. Sent by global rank 0."""
        if global_rank() != 0:
            return
        self._policies[id(owner)] = policy
        parts = sorted(set(self._policies.values()))
        text = parts[0] if len(parts) == 1 else f"KeepAny([{', '.join(parts)}])"
        try:
            self.client.set_retention(text)
        except FailedPrecondition as exc:  # the operator keeps every job's retention
            log.warning("save_top_k is not applied to job %r: %s", self.job, exc)

    def remove(self, path: Any) -> None:
        """Lightning no longer keeps ``path``: the step is unpinned when no name is left."""
        name = self._name(path)
        step = self.names.pop(name, None)
        if step is None:
            log.debug("remove_checkpoint(%r): not a name of job %r; nothing to do", name, self.job)
            return
        self._settle(None, None, self._orphans([step]))

    def _point(self, name: str, step: int) -> list[int]:
        """Name ``step`` ``name``; the steps that lost their last name."""
        old = self.names.get(name)
        self.names[name] = step
        return self._orphans([] if old is None else [old])

    def _orphans(self, steps: list[int]) -> list[int]:
        named = set(self.names.values())
        return [s for s in steps if s not in named and s in self._pinned]

    def _settle(self, handle: SaveHandle | None, pin: int | None, unpin: list[int]) -> None:
        """After a save: wait for LOCAL (here, or on the worker thread), then pin it and
        unpin what lost its names, in order."""
        if pin is not None:
            self._pinned.add(pin)
        self._pinned.difference_update(unpin)
        if handle is None and pin is None and not unpin:
            return
        job = Settle(self.client, handle, pin, unpin)
        if self.wait_local:
            job()
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, "ckptd-lightning")
        self._last = self._worker.submit(self._background, job)

    def _background(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # raised to the trainer by the next save or finish()
            with self._lock:
                self._error = self._error or exc

    def _raise_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def finish(self) -> None:
        """Wait until every save is LOCAL and pinned; raise the first failure."""
        if self._last is not None and self._pid == os.getpid():
            self._last.result()
        self._raise_error()

    def close(self) -> None:
        """:meth:`finish`, then close this process's client."""
        try:
            self.finish()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            if self._client is not None and self._pid == os.getpid():
                self._client.close()
            self._client = None

    def _start_fresh(self, step: int) -> None:
        """The first save of a run that restored nothing, into a job that has steps: say
        so once (``fit(ckpt_path="last")`` without ``CkptdModelCheckpoint`` trains from
        scratch: Lightning looks for ``last*.ckpt`` files), and unpin the steps an
        earlier run's Lightning kept: this run's names never refer to them, and a pin
        would refuse this run's save of the same step number (the daemon's timeline
        rule decides what becomes of them)."""
        if self._loaded or self._warned:
            return
        self._warned = True
        latest = self.client.latest_step()
        if latest is None:
            return
        log.warning(
            "job %r already holds checkpoints up to step %d, and this run saves step %d "
            "without having restored one (the steps an earlier run kept are unpinned). To "
            "resume instead, pass Trainer(callbacks=[CkptdModelCheckpoint(...)]) and "
            "fit(ckpt_path='last') (or ckpt_path='%s/latest'); to keep runs apart, give "
            "each its own job name.",
            self.job,
            latest,
            step,
            self.url,
        )
        reconcile_pins(self.client, set(), METRIC)

    # -- load -----------------------------------------------------------------------
    def latest_step(self) -> int | None:
        """The newest step this node can restore (from any tier), None if none. A step
        the daemon acknowledged and is still writing (a trainer killed right after
        its save returned, restarted at once) is waited for: it is the newest."""
        self._wait_in_flight()
        return self.client.latest_step()

    def _wait_in_flight(self) -> None:
        for row in self.client.list():
            if row.state == "STAGING":
                try:
                    SaveHandle(self.client, row.step).wait("local", IN_FLIGHT_TIMEOUT)
                except (CkptdError, TimeoutError) as exc:  # not restorable: not a candidate
                    log.info("step %d of job %r is not restorable: %s", row.step, self.job, exc)

    def load(self, path: Any, map_location: MapLocation, weights_only: bool | None) -> Any:
        """The checkpoint dict saved as the step ``path`` names (``ckptd://<job>/latest``,
        ``ckptd://<job>/<step>``, or a name Lightning saved under)."""
        step = self.step_of(self._name(path))
        if step is None:
            self._wait_in_flight()
        if step is None and _world_size() > 1:
            from ..distributed import agree_on_step

            step = agree_on_step(self.client)  # a collective: every rank loads
            if step is None:
                raise CheckpointNotFound(
                    f"no step of job {self.job!r} can be restored on every rank; "
                    "start without ckpt_path (or check `ckptd ls` on each node)"
                )
        tree, meta = self.client.restore(step=step, rank=0)
        lmeta = meta.get("lightning") if isinstance(meta, dict) else None
        if not isinstance(lmeta, dict) or "replace" not in lmeta:
            raise InvalidArgument(
                f"{path!r}: step {step if step is not None else '(latest)'} of job "
                f"{self.job!r} was not saved by ckptd's Lightning integration; restore it "
                "with ckptd.client.Client.restore"
            )
        checkpoint = decode(tree, lmeta["replace"], weights_only, map_location)
        restored = int(lmeta["step"])
        if not self._handed:  # a run resuming: take over its names and pins
            self._adopt_names(lmeta.get("names") or {}, checkpoint, restored)
        self._handed.add(restored)
        self._loaded = True
        log.info("restored step %d of job %r for %s", restored, self.job, path)
        return checkpoint

    def step_of(self, name: str) -> int | None:
        """The step ``name`` refers to; None for the latest. Raises NotFound."""
        url = split_url(name)
        if url is not None:
            job, rest = url
            if job != self.job:
                raise InvalidArgument(
                    f"{name!r} names job {job!r}, but this CheckpointIO saves and loads "
                    f"job {self.job!r}"
                )
            if rest in ("", LATEST):
                return None
            if rest.isdigit():
                return int(rest)
        step = self.names.get(name)
        if step is None:
            raise CheckpointNotFound(
                f"{name!r} is not a checkpoint of job {self.job!r} known to this process; "
                f"pass ckpt_path='last' (with CkptdModelCheckpoint), '{self.url}/latest' "
                f"or '{self.url}/<step>' (`ckptd ls {self.job}` lists the steps)"
            )
        return step

    def _adopt_names(self, saved: dict[str, Any], checkpoint: dict[str, Any], step: int) -> None:
        """Take over the restored step's names (the first load of a store that has
        saved nothing: a run resuming; later loads, such as ``test(ckpt_path="best")``
        after ``fit``, leave the names alone); on rank 0, set the pins to match."""
        self.names = names_after_restore(saved, checkpoint, step)
        if global_rank() == 0:
            self._pinned = reconcile_pins(self.client, set(self.names.values()), METRIC)

    # -- helpers ----------------------------------------------------------------------
    def _name(self, path: Any) -> str:
        name = os.fspath(path)
        if not isinstance(name, str):
            raise InvalidArgument(f"checkpoint path {path!r} must be a str path")
        return name

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the trainer's plugins into each process: no client, no thread.
        state = dict(self.__dict__)
        state.update(_client=None, _pid=0, _worker=None, _last=None, _error=None)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        STORES[self.job] = self


def _global_step(checkpoint: Any) -> int:
    step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgument(
            "a Lightning checkpoint carries its 'global_step' (a non-negative int), which "
            f"ckptd uses as the step; this one has {step!r}"
        )
    return step


def _storage_options(options: Any) -> tuple[bool, dict[str, float]]:
    """``storage_options`` of ``Trainer.save_checkpoint``: ``{"milestone": bool,
    "metrics": {name: number}}`` (both optional)."""
    if options is None:
        return False, {}
    if not isinstance(options, dict) or set(options) - {"milestone", "metrics"}:
        raise TypeError(
            "storage_options for ckptd are {'milestone': bool, 'metrics': {name: number}}, "
            f"not {options!r}"
        )
    return bool(options.get("milestone", False)), dict(options.get("metrics") or {})
