"""PyTorch Lightning through ckptd: a ``CheckpointIO`` that saves into the node
daemon's shared memory and loads from its fastest tier, and a ``ModelCheckpoint``
whose ``fit(ckpt_path="last")`` resumes from ckptd (after the node's disk is gone,
from the bucket)::

    from ckptd.client.lightning import CkptdAsyncCheckpointIO, CkptdModelCheckpoint

    trainer = L.Trainer(
        plugins=[CkptdAsyncCheckpointIO("run-42")],
        callbacks=[CkptdModelCheckpoint(save_last=True, every_n_train_steps=100)],
    )
    trainer.fit(model, ckpt_path="last")

``ckpt_path`` also takes ``"ckptd://<job>/latest"`` and ``"ckptd://<job>/<step>"``;
``Model.load_from_checkpoint`` takes those and every name Lightning saved under
(``trainer.checkpoint_callback.best_model_path``), and :func:`load_checkpoint` is
``torch.load`` for them.
How steps, names, pins and ranks map: :mod:`ckptd.client.lightning.store`; the
checkpoint dict's layout: :mod:`ckptd.client.torch.codec`; the user's guide:
docs/integrations/lightning.md. For the standalone ``pytorch_lightning`` package,
import the same names from :mod:`ckptd.client.lightning.pl`.

Importing this module imports neither torch nor Lightning; the classes load
``lightning.pytorch`` on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .files import load_checkpoint
    from .io import CkptdAsyncCheckpointIO, CkptdCheckpointIO, CkptdModelCheckpoint

__all__ = ["CkptdAsyncCheckpointIO", "CkptdCheckpointIO", "CkptdModelCheckpoint", "load_checkpoint"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "load_checkpoint":
        from . import files as source
    else:
        from . import io as source  # type: ignore[no-redef]

    value = getattr(source, name)
    globals()[name] = value
    return value
