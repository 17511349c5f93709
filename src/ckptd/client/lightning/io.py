"""ckptd's Lightning classes for the ``lightning`` package (:mod:`ckptd.client.lightning`
imports them from here on first use)."""

from __future__ import annotations

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from .mixins import AsyncMixin, CheckpointIOMixin, ModelCheckpointMixin


class CkptdCheckpointIO(CheckpointIOMixin, CheckpointIO):
    """Saves and loads Lightning checkpoints through the node's ckptd daemon.

    ``CkptdCheckpointIO(job, socket=None, **client_options)``: ``job`` names the
    run's checkpoints (``ckptd://<job>``); ``client_options`` go to
    :class:`ckptd.client.Client`. ``save_checkpoint`` returns once the step is
    LOCAL (on this node's disk), as ``TorchCheckpointIO`` returns once its file is
    written; :class:`CkptdAsyncCheckpointIO` returns as soon as the daemon owns
    the bytes. See docs/integrations/lightning.md.
    """


class CkptdAsyncCheckpointIO(AsyncMixin, CkptdCheckpointIO):
    """:class:`CkptdCheckpointIO` whose ``save_checkpoint`` returns once the tensors are
    copied into the daemon's shared memory (no clone, unlike ``AsyncCheckpointIO``:
    the copy is the snapshot); the daemon writes them in the background. A save that
    fails later is raised by the next ``save_checkpoint`` or at ``teardown``."""


class CkptdModelCheckpoint(ModelCheckpointMixin, ModelCheckpoint):
    """``ModelCheckpoint`` for ckptd: ``fit(ckpt_path="last")`` resumes from the job's
    newest restorable step (from the bucket after the node's disk is lost), never
    silently from scratch. ``dirpath`` defaults to ``ckptd://<job>``; every other
    argument is ``ModelCheckpoint``'s. Needs ``Trainer(plugins=[CkptdCheckpointIO(job)])``."""


__all__ = ["CkptdAsyncCheckpointIO", "CkptdCheckpointIO", "CkptdModelCheckpoint"]
