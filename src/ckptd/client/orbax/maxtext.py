"""MaxText: its own checkpointing module, saving through ckptd.

MaxText (``maxtext.common.checkpointing``, up to 0.2.4: Orbax's v0 API) creates its
manager in ``create_orbax_checkpoint_manager`` with Orbax's arguments (item names
and handlers, save decision and preservation policies). :func:`use_in_maxtext`
wraps that function so the ``ocp.CheckpointManager`` it creates is ckptd's, with
those same arguments; everything else in MaxText (``load_state_if_possible``,
``maybe_save_checkpoint``, the train loop) runs unchanged::

    from ckptd.client import orbax as ckptd_orbax
    ckptd_orbax.use_in_maxtext()        # job: MaxText's run_name
    from maxtext.trainers.pre_train import train
    train.main(sys.argv)
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

_swap = threading.Lock()


def use_in_maxtext(
    job: str | None = None,
    socket: str | os.PathLike[str] | None = None,
    **manager_kwargs: Any,
) -> None:
    """Make MaxText's ``create_orbax_checkpoint_manager`` return ckptd's
    :class:`~ckptd.client.orbax.CheckpointManager` (``job``: default, the run name
    from MaxText's ``<base_output_directory>/<run_name>/checkpoints``;
    ``manager_kwargs``: more of its keyword arguments). Call it before the train
    loop starts; calling it again replaces the settings."""
    from maxtext.common import checkpointing  # type: ignore[import-not-found]

    from .manager import CheckpointManager

    original = getattr(
        checkpointing.create_orbax_checkpoint_manager,
        "__ckptd_wrapped__",
        checkpointing.create_orbax_checkpoint_manager,
    )
    ours = functools.partial(CheckpointManager, job=job, socket=socket, **manager_kwargs)

    @functools.wraps(original)
    def create(*args: Any, **kwargs: Any) -> Any:
        # MaxText builds Orbax's options and policies, then calls ocp.CheckpointManager:
        # ckptd's takes the same arguments, so only that one name is swapped, only here.
        ocp = checkpointing.ocp
        with _swap:
            saved = ocp.CheckpointManager
            ocp.CheckpointManager = ours
            try:
                return original(*args, **kwargs)
            finally:
                ocp.CheckpointManager = saved

    create.__ckptd_wrapped__ = original  # type: ignore[attr-defined]
    checkpointing.create_orbax_checkpoint_manager = create


__all__ = ["use_in_maxtext"]
