"""The standalone ``pytorch_lightning`` package's ckptd classes, kept at this import path
for code that names it: they live in :mod:`ckptd.client.lightning.pl`."""

from __future__ import annotations

from .lightning.pl import CkptdAsyncCheckpointIO, CkptdCheckpointIO, CkptdModelCheckpoint

__all__ = ["CkptdAsyncCheckpointIO", "CkptdCheckpointIO", "CkptdModelCheckpoint"]
