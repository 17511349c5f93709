"""The bodies of ckptd's Lightning classes, apart from their Lightning bases, so the
same code serves the ``lightning`` package (:mod:`ckptd.client.lightning`) and the
standalone ``pytorch_lightning`` one (:mod:`ckptd.client.lightning.pl`)."""

from __future__ import annotations

import os
from typing import Any

from ckptd.core.errors import InvalidArgument

from ..client import Client
from ..torch.codec import MapLocation
from .fs import register
from .store import LATEST, CheckpointStore

register()


class CheckpointIOMixin:
    """A Lightning ``CheckpointIO`` over a :class:`CheckpointStore`
    (docs/integrations/lightning.md)."""

    _wait_local = True

    def __init__(
        self,
        job: str,
        socket: str | os.PathLike[str] | None = None,
        **client_options: Any,
    ) -> None:
        self.store = CheckpointStore(job, socket, self._wait_local, client_options)
        """The job's steps, names and pins (shared with ``CkptdModelCheckpoint``)."""

    @property
    def job(self) -> str:
        """The ckptd job this plugin saves to and loads from."""
        return self.store.job

    @property
    def client(self) -> Client:
        """This process's :class:`ckptd.client.Client` of the job."""
        return self.store.client

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Hand ``checkpoint`` to the node's daemon as step ``checkpoint["global_step"]``,
        named ``path``. ``storage_options``: ``{"milestone": True}`` keeps it in the
        bucket whatever the retention policy, ``{"metrics": {...}}`` records numbers
        for ``KeepBest``."""
        self.store.save(checkpoint, path, storage_options)

    def load_checkpoint(
        self, path: Any, map_location: MapLocation = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint saved as ``path`` (``ckptd://<job>/latest``, ``ckptd://<job>/<step>``
        or a name it was saved under), restored from the fastest tier holding it;
        tensors on the CPU unless ``map_location`` says otherwise, pickled values read
        with ``weights_only`` as ``torch.load`` would."""
        loaded: dict[str, Any] = self.store.load(path, map_location, weights_only)
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        """Lightning no longer keeps ``path``: once no name of its step is left, the
        step is unpinned and ckptd's retention decides when it goes."""
        self.store.remove(path)

    def teardown(self) -> None:
        """Wait for the saves still being written; raise the first failure."""
        self.store.finish()


class AsyncMixin:
    """The asynchronous form: ``save_checkpoint`` returns once the daemon owns the bytes."""

    _wait_local = False


class ModelCheckpointMixin:
    """``ModelCheckpoint`` whose ``fit(ckpt_path="last")`` resumes from ckptd's newest step."""

    dirpath: Any

    save_top_k: int
    monitor: str | None
    mode: str

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Default ``dirpath`` to ``ckptd://<job>`` (the names of the saved steps), and
        make ``save_top_k`` the job's retention in every tier (:meth:`retention`)."""
        store = store_of(trainer)
        if self.dirpath is None:
            self.dirpath = store.url
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        store.keep(self, self.retention())

    def retention(self) -> str:
        """What Lightning keeps, as a ckptd policy: every checkpoint
        (``save_top_k=-1``), the best ``save_top_k`` by the monitored value (sent with
        each save as a metric of its name), or the newest (no monitor, or only
        ``save_last``). The newest step and what Lightning still names (pinned) are
        kept whatever the policy."""
        k = int(self.save_top_k)
        if k == -1:
            return "KeepAll()"
        if self.monitor is None or k == 0:
            return f"KeepLatest({max(k, 1)})"
        return f"KeepBest({self.monitor!r}, {k}, {self.mode!r})"

    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        """Send the monitored value with the save, for :meth:`retention`'s ``KeepBest``."""
        value = trainer.callback_metrics.get(self.monitor) if self.monitor else None
        if value is not None:
            store_of(trainer).pending_metrics[str(self.monitor)] = float(value)
        super()._save_checkpoint(trainer, filepath)  # type: ignore[misc]

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        """``{"ckptd://<job>/latest"}`` while the job has a step this node can restore
        (its disk or the bucket); the ranks agree on the step when loading it."""
        store = store_of(trainer)
        return {f"{store.url}/{LATEST}"} if store.latest_step() is not None else set()


def store_of(trainer: Any) -> CheckpointStore:
    """The store of the trainer's ckptd CheckpointIO (unwrapping Lightning's wrappers)."""
    io = trainer.strategy.checkpoint_io
    for _ in range(8):
        store = getattr(io, "store", None)
        if isinstance(store, CheckpointStore):
            return store
        io = getattr(io, "checkpoint_io", None)
    raise InvalidArgument(
        "CkptdModelCheckpoint needs the trainer to save through ckptd: "
        "Trainer(plugins=[CkptdCheckpointIO('<job>')], callbacks=[CkptdModelCheckpoint(...)])"
    )
