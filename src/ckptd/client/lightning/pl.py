"""ckptd's Lightning classes for the standalone ``pytorch_lightning`` package: the same
as :mod:`ckptd.client.lightning`'s, for ``import pytorch_lightning as pl`` code."""

from __future__ import annotations

from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from pytorch_lightning.callbacks import ModelCheckpoint

from .mixins import AsyncMixin, CheckpointIOMixin, ModelCheckpointMixin


class CkptdCheckpointIO(CheckpointIOMixin, CheckpointIO):
    """:class:`ckptd.client.lightning.CkptdCheckpointIO` for ``pytorch_lightning``."""


class CkptdAsyncCheckpointIO(AsyncMixin, CkptdCheckpointIO):
    """:class:`ckptd.client.lightning.CkptdAsyncCheckpointIO` for ``pytorch_lightning``."""


class CkptdModelCheckpoint(ModelCheckpointMixin, ModelCheckpoint):
    """:class:`ckptd.client.lightning.CkptdModelCheckpoint` for ``pytorch_lightning``."""


__all__ = ["CkptdAsyncCheckpointIO", "CkptdCheckpointIO", "CkptdModelCheckpoint"]
