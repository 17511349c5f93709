"""A Lightning callback, added to every ``Trainer`` by an entry point, that stops a
half-done migration before it trains: ckptd's CheckpointIO with Lightning's plain
``ModelCheckpoint``.

Lightning's ``fit(ckpt_path="last")`` asks each ``ModelCheckpoint`` for its last
checkpoint; the plain one looks for ``last*.ckpt`` files in a local directory,
finds none (the checkpoints are ckptd steps), warns, and trains from scratch,
whose saves then take over the job's timeline. So, at the start of training, a
trainer that saves through a ckptd CheckpointIO, has no ``CkptdModelCheckpoint``
and restored nothing while its job holds steps is refused, with what to change.
A trainer that does not save through ckptd is left alone (the check is one
attribute walk). Registered under ``lightning.pytorch.callbacks_factory`` and
``pytorch_lightning.callbacks_factory`` (pyproject.toml); Lightning logs at INFO
that it added it.
"""

from __future__ import annotations

from typing import Any

from ckptd.core.errors import CkptdError, FailedPrecondition

from .store import CheckpointStore


def check(trainer: Any) -> None:
    """Refuse ``trainer``'s training as the module says; nothing for other trainers."""
    store = _store(trainer)
    if store is None or store._loaded or int(getattr(trainer, "global_step", 0) or 0) > 0:
        return
    from .mixins import ModelCheckpointMixin

    if any(isinstance(cb, ModelCheckpointMixin) for cb in getattr(trainer, "callbacks", [])):
        return  # CkptdModelCheckpoint: "last" is ckptd's, and a fresh run is warned at its save
    latest: int | None = None
    if int(getattr(trainer, "global_rank", 0)) == 0:
        try:
            latest = store.client.latest_step()
        except CkptdError:
            latest = None  # the daemon answers the first save, with its own error
    latest = trainer.strategy.broadcast(latest, src=0)  # every rank refuses, or none
    if latest is None:
        return
    raise FailedPrecondition(
        f"job {store.job!r} already holds checkpoints up to step {latest}, and this run "
        "would train from scratch over them: Lightning's plain ModelCheckpoint looks for "
        "last*.ckpt files, not ckptd's steps. To resume, use "
        "ckptd.client.lightning.CkptdModelCheckpoint(...) in place of ModelCheckpoint with "
        f"fit(ckpt_path='last'), or pass fit(ckpt_path='{store.url}/latest'); to start a "
        "new run, give it its own job name."
    )


def _store(trainer: Any) -> CheckpointStore | None:
    """The store of the trainer's ckptd CheckpointIO, None if it saves otherwise."""
    strategy = getattr(trainer, "strategy", None)
    io = getattr(strategy, "_checkpoint_io", None)  # not the property: it makes a default
    for _ in range(8):
        store = getattr(io, "store", None)
        if isinstance(store, CheckpointStore):
            return store
        io = getattr(io, "checkpoint_io", None)
    return None


def _guard(base: type) -> Any:
    class CkptdResumeGuard(base):  # type: ignore[misc]
        """Refuses to train from scratch over a ckptd job's steps (see the module)."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            check(trainer)

    return CkptdResumeGuard()


def lightning_callbacks() -> list[Any]:
    """The ``lightning.pytorch.callbacks_factory`` entry point."""
    from lightning.pytorch.callbacks import Callback

    return [_guard(Callback)]


def pytorch_lightning_callbacks() -> list[Any]:
    """The ``pytorch_lightning.callbacks_factory`` entry point."""
    from pytorch_lightning.callbacks import Callback

    return [_guard(Callback)]


__all__ = ["check", "lightning_callbacks", "pytorch_lightning_callbacks"]
