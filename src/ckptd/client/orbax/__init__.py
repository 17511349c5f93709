"""Orbax users: ckptd's ``CheckpointManager``, or keep Orbax's and let ckptd tier its steps.

``ckptd.client.orbax.CheckpointManager`` is Orbax's v0 ``CheckpointManager`` API
(what MaxText up to 0.2.4 calls) saving through ckptd's shared memory, multi-host
(client/orbax/manager.py), and ``ckptd.client.orbax.Checkpointer`` Orbax's v1
``ocp.training.Checkpointer`` (MaxText 0.2.5; client/orbax/training.py):
:func:`use_in_maxtext` makes MaxText create the one it uses. Each is imported when
first named: this module never imports Orbax itself.

Or keep Orbax's own writer (below).

Point the manager at the job's directory in the local tier. The daemon adopts
each step Orbax finishes there (hard links, so Orbax's own ``max_to_keep``
deletions cannot race the upload), drains it byte-identical to
``<remote>/<job>/<step>/`` with ``commit_success.txt`` last, and keeps or
evicts it with ckptd's retention. ``ocp.CheckpointManager("gs://…/<job>")``
reads the bucket copy as it is.

::

    import orbax.checkpoint as ocp
    from ckptd.client import Client
    from ckptd.client import orbax as ckptd_orbax

    client = Client(job="run-42")
    directory = ckptd_orbax.directory(client)   # watched by the daemon
    step = ckptd_orbax.ensure_local(client)      # before the manager lists the steps
    mngr = ocp.CheckpointManager(directory, options=...)
    if step is not None:
        state = mngr.restore(step, args=ocp.args.StandardRestore(abstract_state))

This path never imports Orbax: it only moves directories.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd.core.errors import CheckpointNotFound
from ckptd.proto import ckptd_pb2 as pb

from ..client import Client
from ..handle import SaveHandle

if TYPE_CHECKING:
    from .manager import CheckpointManager, StepAlreadyExistsError
    from .maxtext import use_in_maxtext
    from .training import Checkpointer

_LAZY = {
    "Checkpointer": "training",
    "CheckpointManager": "manager",
    "StepAlreadyExistsError": "manager",
    "use_in_maxtext": "maxtext",
}


def __getattr__(name: str) -> Any:
    """``CheckpointManager`` and ``use_in_maxtext``, imported (with Orbax) when first used."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def directory(client: Client, path: str | os.PathLike[str] | None = None) -> Path:
    """The directory to give ``ocp.CheckpointManager``; the daemon watches it.

    Default: ``<root>/.orbax/<job>`` on the daemon's local tier. ``path`` may name
    another directory on the same filesystem (adoption uses hard links).
    Calling it again is harmless.
    """
    resp = client.low_level.watch(os.path.abspath(path) if path else "")
    return Path(resp.directory)


def bucket_directory(client: Client) -> str:
    """Where the job's Orbax steps are in the bucket (``<remote>/<job>``), as a path
    ``ocp.CheckpointManager`` accepts (``file://`` becomes a plain path); empty
    without a remote tier. Orbax reads ``gs://`` and local paths, not ``s3://``:
    restore S3 copies with :func:`ensure_local`."""
    # GetStatus, not Watch: asking where the bucket is must not change what is watched.
    remote = client.low_level.status().remote
    return f"{remote.rstrip('/')}/{client.job}".removeprefix("file://") if remote else ""


def ensure_local(
    client: Client,
    step: int | None = None,
    directory: str | os.PathLike[str] | None = None,
    timeout: float = 3600.0,
) -> int | None:
    """Make sure ``step`` (default: the newest adopted step in any tier) is in the
    Orbax directory, verified, and return its number; ``None`` when the job has
    no adopted step anywhere (a fresh start).

    A step the node lost comes back from the bucket (any backend, S3 included)
    through ckptd's local tier; a step ckptd holds locally but Orbax deleted is
    hard-linked back. Call it before creating the ``CheckpointManager`` (or call
    ``mngr.reload()`` afterwards): the manager lists its steps when created.
    """
    req = pb.EnsureLocalRequest(
        job=client.job, directory=os.path.abspath(directory) if directory else ""
    )
    if step is not None:
        req.step = int(step)
    try:
        resp = client.low_level.ensure_local(req, timeout)
    except CheckpointNotFound:
        if step is not None:
            raise
        return None
    return int(resp.step)


def wait(client: Client, step: int, stage: str = "durable", timeout: float = 600.0) -> None:
    """Block until Orbax's ``step`` is adopted and reaches ``stage`` ("local" or
    "durable"). Call ``mngr.wait_until_finished()`` first: the daemon adopts a
    step once Orbax has finished it. Raises ``TimeoutError`` if it does not."""
    deadline = time.monotonic() + timeout
    while True:
        known = any(c.step == step for c in client.list())
        if known:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"step {step} of job {client.job!r} was not adopted within {timeout} s: is "
                "it finished in the directory ckptd_orbax.directory() returned?"
            )
        time.sleep(0.1)
    SaveHandle(client, step).wait(stage, timeout=max(0.0, deadline - time.monotonic()))


__all__ = [
    "CheckpointManager",
    "Checkpointer",
    "StepAlreadyExistsError",
    "bucket_directory",
    "directory",
    "ensure_local",
    "use_in_maxtext",
    "wait",
]
