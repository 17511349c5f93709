"""HF accelerate's ``save_state`` / ``load_state`` with ckptd tiering every checkpoint::

    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    from ckptd.client import accelerate as ckptd_accelerate

    accelerator = Accelerator(project_config=ProjectConfiguration(
        project_dir="runs/42", automatic_checkpoint_naming=True, total_limit=3))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ckptd_accelerate.use(accelerator, "run-42")
    accelerator.load_state()        # the newest step ckptd holds; nothing on a fresh start
    ...
    accelerator.save_state()        # unchanged: then adopted by the node's daemon

- **Each save.** After accelerate's ``save_state`` wrote the folder (the model's
  weights, the optimizer, schedulers, samplers, every process's RNG states, FSDP's
  sharded state), the processes meet at a barrier and each process that wrote it
  (the main process, or each node's with ``save_on_each_node``) hands it to its
  node's daemon (``Client.adopt``: hard links, then drained byte-identical to the
  bucket). The step is the number the folder's name ends with
  (``checkpoint_<iteration>`` with automatic naming).
- **Retention.** ``total_limit`` becomes the job's retention in every ckptd tier
  (``KeepLatest(total_limit)``; no limit: the node's policy), within the limits
  the operator sets; accelerate's own deletions of older folders do not touch
  ckptd's copies.
- **Each load.** ``load_state()`` without a folder, with automatic naming: the
  writing processes agree on the newest step every node holds, each puts it back
  into ``project_dir/checkpoints/checkpoint_<step>`` (from the bucket when the node
  lost its disk) and accelerate loads that folder, not a newer one a save cut
  short left behind. With no step in ckptd, accelerate's own newest folder loads as
  before (a run moving to ckptd). ``load_state(folder)`` loads that folder; a
  ``checkpoint_<step>`` folder the node lost is put back first. Afterwards
  ``save_iteration`` is the loaded step + 1, so the next ``save_state`` does not
  collide with the loaded folder (accelerate leaves that to the user).

See docs/integrations/accelerate.md.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path
from typing import Any

from ckptd.core.errors import CheckpointNotFound, CkptdError, FailedPrecondition, InvalidArgument
from ckptd.proto import ckptd_pb2 as pb

from .adopted import agree, barrier, gather, world
from .client import Client
from .handle import SaveHandle

log = logging.getLogger("ckptd.accelerate")

LAYOUT = "accelerate"
"""The daemon's name for accelerate's step folders (``checkpoint_<step>``)."""
PREFIX = "checkpoint_"
_STEP = re.compile(r"(\d+)$")


def step_of(folder: str | os.PathLike[str]) -> int:
    """The ckptd step of a ``save_state`` folder: the number its name ends with."""
    match = _STEP.search(Path(folder).name)
    if match is None:
        raise InvalidArgument(
            f"{os.fspath(folder)!r}: ckptd takes the step from the folder's name, which must "
            "end with it (accelerate's automatic naming: checkpoint_<iteration>)"
        )
    return int(match.group(1))


class CkptdAccelerate:
    """What :func:`use` installed on one ``Accelerator`` (see the module)."""

    def __init__(
        self,
        accelerator: Any,
        job: str,
        socket: str | os.PathLike[str] | None,
        client_options: dict[str, Any],
        timeout: float,
    ) -> None:
        self.accelerator = accelerator
        self.job, self.socket, self.options, self.timeout = job, socket, client_options, timeout
        self._client: Client | None = None
        self.last: SaveHandle | None = None
        """The handle of this process's last adoption (None before the first)."""

    @property
    def client(self) -> Client:
        """The job's client (made on first use). Each folder accelerate names is written."""
        if self._client is None:
            self._client = Client(self.job, self.socket, **{"supersede": False, **self.options})
        return self._client

    @property
    def writes(self) -> bool:
        """Whether this process writes (and so adopts) the folders."""
        acc = self.accelerator
        each_node = bool(acc.project_configuration.save_on_each_node)
        return bool(acc.is_local_main_process if each_node else acc.is_main_process)

    def keep(self) -> None:
        """Make ``total_limit`` the job's retention in every tier (None: the node's)."""
        if not self.writes:
            return
        limit = self.accelerator.project_configuration.total_limit
        try:  # no limit too: an earlier run's policy must not stay
            self.client.set_retention(f"KeepLatest({int(limit)})" if limit else None)
        except FailedPrecondition as exc:  # the operator keeps every job's retention
            log.warning("total_limit is not applied to job %r: %s", self.job, exc)

    def adopt(self, folder: str | os.PathLike[str]) -> None:
        """Hand ``folder``, which ``save_state`` just finished on every process, over."""
        step = step_of(folder)
        barrier()  # every process's RNG states are in the folder
        if self.writes:
            self.last = self.client.adopt(step, folder)

    def bring_back(self, input_dir: str | os.PathLike[str] | None) -> str | None:
        """The folder ``load_state`` should read: the newest step every node holds
        (or ``input_dir``'s) put back; None when ckptd holds no step of the job and
        accelerate should look for itself. A collective when the job has several
        processes."""
        acc = self.accelerator
        if input_dir is None:
            if not acc.project_configuration.automatic_checkpoint_naming:
                return None  # accelerate refuses this itself, with its own message
            directory, step = Path(acc.project_dir, "checkpoints"), None
        else:
            folder = Path(input_dir)
            if not folder.name.startswith(PREFIX):
                return os.fspath(input_dir)  # not a name ckptd puts back
            # Every process takes the same branch: one node lacking it puts it back.
            if not any(gather("" if folder.is_dir() else "missing")):
                return os.fspath(input_dir)
            directory, step = folder.parent, step_of(folder)
        if world() > 1:
            step = agree(self.client, step, self.writes)
            if step is None:
                return None if input_dir is None else os.fspath(input_dir)
        failure: CkptdError | None = None
        if self.writes:
            req = pb.EnsureLocalRequest(
                job=self.job, directory=str(directory.absolute()), layout=LAYOUT
            )
            if step is not None:
                req.step = int(step)
            try:
                resp = self.client.low_level.ensure_local(req, self.timeout)
            except CkptdError as exc:
                if isinstance(exc, CheckpointNotFound) and step is None:
                    return None  # one process, and nothing adopted anywhere
                failure = exc
            else:
                step = int(resp.step)
                how = (
                    "from the bucket"
                    if resp.fetched
                    else "linked back"
                    if resp.linked
                    else "in place"
                )
                log.info("loading job %r from step %d (%s, %s)", self.job, step, resp.path, how)
        errors = gather(str(failure) if failure else "")
        if failure is not None:
            raise failure
        if any(errors):
            raise FailedPrecondition(
                f"another process could not put step {step} back: {next(e for e in errors if e)}"
            )
        return None if step is None else os.fspath(directory / f"{PREFIX}{step}")

    def close(self) -> None:
        """Close the client this made."""
        if self._client is not None:
            self._client.close()
            self._client = None


def use(
    accelerator: Any,
    job: str,
    *,
    socket: str | os.PathLike[str] | None = None,
    client_options: dict[str, Any] | None = None,
    timeout: float = 3600.0,
) -> CkptdAccelerate:
    """Make ``accelerator``'s ``save_state`` / ``load_state`` go through ckptd as ``job``
    (see the module). Call it on every process, after ``Accelerator(...)``."""
    if not isinstance(job, str) or not job or "/" in job:
        raise InvalidArgument(f"job must be a ckptd job name such as 'run-42', not {job!r}")
    ours = CkptdAccelerate(accelerator, job, socket, dict(client_options or {}), timeout)
    save_state, load_state = accelerator.save_state, accelerator.load_state

    @functools.wraps(save_state)
    def saving(output_dir: Any = None, *args: Any, **kwargs: Any) -> Any:
        if (
            output_dir is not None
            and not accelerator.project_configuration.automatic_checkpoint_naming
        ):
            step_of(output_dir)  # a name without its step is refused before the save
        location = save_state(output_dir, *args, **kwargs)
        ours.adopt(location if location is not None else output_dir)
        return location

    @functools.wraps(load_state)
    def loading(input_dir: Any = None, *args: Any, **kwargs: Any) -> Any:
        automatic = bool(accelerator.project_configuration.automatic_checkpoint_naming)
        if input_dir is None and not automatic:
            return load_state(None, *args, **kwargs)  # accelerate's own error
        folder = ours.bring_back(input_dir)
        if folder is None and input_dir is None:
            folder = _newest_folder(accelerator)  # a run moving to ckptd: accelerate's pick
            if folder is None:
                log.info("job %r has no checkpoint: starting fresh", job)
                return None
        folder = folder if folder is not None else os.fspath(input_dir)
        result = load_state(folder, *args, **kwargs)
        if automatic:  # the next save_state's folder follows the loaded one
            accelerator.project_configuration.iteration = step_of(folder) + 1
        return result

    accelerator.save_state, accelerator.load_state = saving, loading
    ours.keep()
    return ours


def _newest_folder(accelerator: Any) -> str | None:
    """The folder accelerate's automatic naming would load by itself: the highest
    ``checkpoint_<n>`` under ``project_dir/checkpoints`` (None: there is none)."""
    base = Path(accelerator.project_dir, "checkpoints")
    try:
        found = [(step_of(p), p) for p in base.iterdir() if p.is_dir() and _STEP.search(p.name)]
    except FileNotFoundError:
        return None
    return os.fspath(max(found)[1]) if found else None


__all__ = ["LAYOUT", "CkptdAccelerate", "step_of", "use"]
