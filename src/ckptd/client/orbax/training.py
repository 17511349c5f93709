"""``ocp.training.Checkpointer`` (Orbax's v1 API, what MaxText 0.2.5 builds) saving
through ckptd's shared memory.

A subclass of Orbax's own class (MaxText checks ``isinstance``) that never runs its
constructor: every call goes to ckptd's :class:`~ckptd.client.orbax.CheckpointManager`
(manager.py), which holds one named item per checkpointable. What maps to what
(docs/integrations/maxtext.md):

- the constructor takes Orbax's ``directory``, ``context``, ``save_decision_policy``,
  ``preservation_policy`` (the job's ckptd retention, as the v0 manager maps it),
  ``custom_metadata``; and ckptd's ``job``, ``socket``, ``client``, ``replicas``;
- ``save_checkpointables(_async)`` / ``save(_async)``: each pytree checkpointable
  is an item; the save decision policy decides unless ``force``; a step saved
  before raises Orbax's ``StepAlreadyExistsError`` (a ``FileExistsError``);
  ``_async`` returns once the arrays are in shared memory, with a response whose
  ``result()`` waits for LOCAL; ``None`` when the policy says no;
- ``load_checkpointables`` / ``load``: the checkpointables the abstract dict names,
  on the abstract leaves' shardings; with the context's ``partial_load`` (MaxText
  sets it), saved entries the target lacks are left out and target entries the
  step lacks come back as given;
- ``latest``, ``checkpoints``, ``should_save``, ``metadata``, ``root_metadata``,
  ``wait``, ``is_saving_in_progress``, ``reload``, ``close``.

Not provided: checkpointables that are not pytrees (``StatefulCheckpointable``,
such as MaxText's grain iterator: refused with a message), ``overwrite``,
``delete``, ``cancel``, asynchronous loads.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

from ckptd.core.errors import InvalidArgument

from ..client import Client
from ..leaves.jax_arrays import Replicas
from . import items as items_lib
from .manager import CheckpointManager

ocp = items_lib.ocp
v1 = ocp.experimental.v1
_Base: Any = v1.training.Checkpointer
_errors = v1.training.errors


class AsyncResponse:
    """What ``save_*_async`` returns: ``result()`` waits until the step is LOCAL (True),
    raising what the save raised."""

    def __init__(self, done: Future[None] | None) -> None:
        self._done = done

    def result(self, timeout: float | None = None) -> bool:
        if self._done is not None:
            self._done.result(timeout)
        return True


class Checkpointer(_Base):  # type: ignore[misc]
    """Orbax's ``ocp.training.Checkpointer`` over the node's ckptd daemon (see the
    module)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        context: Any = None,
        save_decision_policy: Any = None,
        preservation_policy: Any = None,
        step_name_format: Any = None,
        custom_metadata: dict[str, Any] | None = None,
        cleanup_tmp_directories: bool = False,
        lightweight_initialize: bool = False,
        logger: Any = None,
        job: str | None = None,
        socket: str | os.PathLike[str] | None = None,
        client: Client | None = None,
        replicas: Replicas = "process",
    ) -> None:
        # Orbax's constructor is not run: it would create its own v0 manager.
        del step_name_format, cleanup_tmp_directories, lightweight_initialize, logger
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=save_decision_policy,
            preservation_policy=preservation_policy,
            enable_async_checkpointing=True,
        )
        self._partial = bool(_option(context, "pytree_options", "loading", "partial_load"))
        self._manager = CheckpointManager(
            directory,
            options=options,
            metadata=custom_metadata,
            item_names=(),
            job=job,
            socket=socket,
            client=client,
            replicas=replicas,
        )
        self._manager._default_item = False  # v1's checkpointables are always named

    @property
    def client(self) -> Client:
        """The ckptd client every save and restore goes through."""
        return self._manager.client

    @property
    def directory(self) -> Any:
        """The directory given (an ``epath.Path``); ckptd does not write there."""
        return self._manager.directory

    @property
    def latest(self) -> Any:
        """The newest step's ``CheckpointMetadata`` (None if there is none)."""
        step = self._manager.latest_step()
        return None if step is None else self._info(step)

    @property
    def checkpoints(self) -> list[Any]:
        """Every step that exists, oldest first, as ``CheckpointMetadata``."""
        return [self._info(step) for step in self._manager.all_steps()]

    def _info(self, step: int) -> Any:
        return v1.training.CheckpointMetadata(step, self.directory / str(step), metadata=None)

    def should_save(self, step: int) -> bool:
        """Orbax's save decision for ``step`` (its policy objects, fed ckptd's state)."""
        return self._manager.should_save(step)

    # -- save ------------------------------------------------------------------
    def save_checkpointables_async(
        self,
        step: int,
        checkpointables: dict[str, Any],
        *,
        force: bool = False,
        overwrite: bool = False,
        metrics: dict[str, Any] | None = None,
        custom_metadata: dict[str, Any] | None = None,
    ) -> AsyncResponse | None:
        """Save each checkpointable as an item of ``step``; returns once the arrays are
        in shared memory (None: the save decision policy said no)."""
        if overwrite:
            raise InvalidArgument(
                "overwrite=True is not supported by ckptd: a step is written once "
                "(restore an older step and save on: a new timeline replaces the newer ones)"
            )
        if not isinstance(checkpointables, dict) or not checkpointables:
            raise InvalidArgument("checkpointables must be a dict of name -> pytree")
        if int(step) in self._manager.all_steps():
            raise _errors.StepAlreadyExistsError(f"step {step} already exists")
        items = {n: ocp.args.StandardSave(_pytree(n, t)) for n, t in checkpointables.items()}
        args = ocp.args.Composite(**items)
        saved = self._manager.save(
            int(step), args=args, force=force, metrics=metrics, custom_metadata=custom_metadata
        )
        return AsyncResponse(self._manager._pending) if saved else None

    def save_checkpointables(self, step: int, checkpointables: dict[str, Any], **kw: Any) -> bool:
        """:meth:`save_checkpointables_async`, waiting until the step is LOCAL."""
        response = self.save_checkpointables_async(step, checkpointables, **kw)
        return response is not None and response.result()

    def save_async(
        self, step: int, state: Any, *, checkpointable_name: str = "state", **kw: Any
    ) -> AsyncResponse | None:
        """One pytree, as the checkpointable ``checkpointable_name``."""
        return self.save_checkpointables_async(step, {checkpointable_name: state}, **kw)

    def save(self, step: int, state: Any, *, checkpointable_name: str = "state", **kw: Any) -> bool:
        """:meth:`save_async`, waiting until the step is LOCAL."""
        return self.save_checkpointables(step, {checkpointable_name: state}, **kw)

    save_pytree = save
    save_pytree_async = save_async

    # -- load ------------------------------------------------------------------
    def load_checkpointables(
        self, step: Any = None, abstract_checkpointables: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The checkpointables of ``step`` (None: the newest) that
        ``abstract_checkpointables`` names (None: all, as saved), arrays on the
        abstract leaves' shardings."""
        number = self._step(step)
        if abstract_checkpointables is None:
            restored = self._manager.restore(number)
        else:
            wanted = {n: self._restore_args(t) for n, t in abstract_checkpointables.items()}
            restored = self._manager.restore(number, args=ocp.args.Composite(**wanted))
        return {name: restored[name] for name in restored.keys()}  # noqa: SIM118 (a Composite)

    def load(
        self, step: Any = None, abstract_state: Any = None, *, checkpointable_name: str = "state"
    ) -> Any:
        """One checkpointable of ``step`` (default ``state``)."""
        wanted = {checkpointable_name: abstract_state}
        if abstract_state is None:
            return self._manager.restore(
                self._step(step), args=ocp.args.Composite(**{checkpointable_name: None})
            )[checkpointable_name]
        return self.load_checkpointables(step, wanted)[checkpointable_name]

    load_pytree = load

    def _restore_args(self, tree: Any) -> Any:
        if tree is None:
            return None
        if self._partial:
            return ocp.args.PyTreeRestore(item=tree, partial_restore=True)
        return ocp.args.StandardRestore(tree)

    def _step(self, step: Any) -> int:
        if step is None:
            latest = self._manager.latest_step()
            if latest is None:
                raise _errors.StepNotFoundError(f"no step of ckptd job {self.client.job!r} to load")
            return latest
        number = int(getattr(step, "step", step))
        if number not in self._manager.all_steps():
            raise _errors.StepNotFoundError(
                f"step {number} of ckptd job {self.client.job!r} does not exist "
                f"(it has {self._manager.all_steps()[-10:]})"
            )
        return number

    # -- metadata and the rest ---------------------------------------------------
    def metadata(self, step: Any = None) -> Any:
        """``CheckpointMetadata`` of ``step`` (None: the newest) whose ``metadata`` is the
        item metadata (trees of ``jax.ShapeDtypeStruct``) of every checkpointable."""
        number = self._step(step)
        meta = self._manager.metadata(number)
        items = meta.item_metadata
        return v1.training.CheckpointMetadata(
            number,
            self.directory / str(number),
            metadata={name: items[name] for name in items.keys()},  # noqa: SIM118
            custom_metadata=meta.custom_metadata,
            metrics=meta.metrics,
        )

    checkpointables_metadata = metadata

    def root_metadata(self) -> Any:
        """The ``custom_metadata`` given to the constructor."""
        return v1.training.RootMetadata(
            directory=self.directory,
            custom_metadata=self._manager.metadata().custom_metadata,
        )

    def is_saving_in_progress(self) -> bool:
        """Whether the last save has not yet reached the node's disk (LOCAL)."""
        return self._manager.is_saving_in_progress()

    def wait(self) -> None:
        """Block until the last save is LOCAL; raise its error if it failed."""
        self._manager.wait_until_finished()

    def reload(self) -> None:
        """Ask the daemons again which steps every process can restore (a collective)."""
        self._manager.reload()

    def close(self) -> None:
        """Wait for the last save, then close the client if this made it."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ckptd.client.orbax.Checkpointer(job={self.client.job!r})"


def _pytree(name: str, tree: Any) -> Any:
    """A checkpointable ckptd saves: a pytree (not an object that saves itself)."""
    if hasattr(tree, "save") and hasattr(tree, "load") and not isinstance(tree, dict):
        raise InvalidArgument(
            f"checkpointable {name!r} is a {type(tree).__name__} that saves itself "
            "(a StatefulCheckpointable, such as MaxText's grain iterator); ckptd saves "
            "pytrees of arrays. MaxText: use dataset_type=synthetic/tfds/hf, or keep "
            "Orbax's Checkpointer and let ckptd adopt its steps (docs/integrations/maxtext.md)"
        )
    return tree


def _option(context: Any, *path: str) -> Any:
    """``context.a.b.c``, None if any part is missing."""
    value = context
    for part in path:
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


__all__ = ["AsyncResponse", "Checkpointer"]
