"""MaxText: its own checkpointing module, saving through ckptd.

MaxText (``maxtext.common.checkpointing``) creates its checkpointer in
``create_orbax_checkpoint_manager`` with Orbax's arguments (save decision and
preservation policies; up to 0.2.4 also item names and handlers): up to 0.2.4 an
``ocp.CheckpointManager`` (Orbax's v0 API), from 0.2.5 an
``ocp.training.Checkpointer`` (v1). :func:`use_in_maxtext` wraps that function so
the object it creates is ckptd's (:class:`~ckptd.client.orbax.CheckpointManager`
or :class:`~ckptd.client.orbax.Checkpointer`, a subclass of Orbax's, as MaxText
checks), with those same arguments; everything else in MaxText
(``load_state_if_possible``, ``maybe_save_checkpoint``, the train loop) runs
unchanged::

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
    :class:`~ckptd.client.orbax.Checkpointer` (MaxText 0.2.5) or
    :class:`~ckptd.client.orbax.CheckpointManager` (up to 0.2.4) (``job``: default, the run name
    from MaxText's ``<base_output_directory>/<run_name>/checkpoints``;
    ``manager_kwargs``: more of its keyword arguments). Call it before the train
    loop starts; calling it again replaces the settings."""
    from maxtext.common import checkpointing  # type: ignore[import-not-found]

    original = getattr(
        checkpointing.create_orbax_checkpoint_manager,
        "__ckptd_wrapped__",
        checkpointing.create_orbax_checkpoint_manager,
    )
    # 0.2.5 imports Orbax's v1 API as `ocp` (its ocp.training.Checkpointer); earlier
    # releases the v0 one (ocp.CheckpointManager).
    training = getattr(checkpointing.ocp, "training", None)
    cls: Any
    if training is not None and hasattr(training, "Checkpointer"):
        from .training import Checkpointer

        where, name, cls = training, "Checkpointer", Checkpointer
    else:
        from .manager import CheckpointManager

        where, name, cls = checkpointing.ocp, "CheckpointManager", CheckpointManager
    ours = functools.partial(cls, job=job, socket=socket, **manager_kwargs)

    @functools.wraps(original)
    def create(*args: Any, **kwargs: Any) -> Any:
        # MaxText builds Orbax's context and policies, then calls Orbax's class:
        # ckptd's takes the same arguments, so only that one name is swapped, only here.
        with _swap:
            saved = getattr(where, name)
            setattr(where, name, ours)
            try:
                return original(*args, **kwargs)
            finally:
                setattr(where, name, saved)

    create.__ckptd_wrapped__ = original  # type: ignore[attr-defined]
    checkpointing.create_orbax_checkpoint_manager = create


__all__ = ["use_in_maxtext"]
