"""``ckptd://<job>/...`` as an fsspec filesystem, so Lightning's path handling sees
ckptd's steps: ``ModelCheckpoint(dirpath="ckptd://run-42")`` and the paths
``fit(ckpt_path="last")`` chooses among (Lightning asks ``exists`` and
``modified`` of each candidate).

Read-only and small: ``ckptd://<job>`` is a directory while the job has a
restorable step (on this node or in the bucket); ``ckptd://<job>/<step>`` and
``ckptd://<job>/latest`` are its steps, and ``ckptd://<job>/<name>`` a name
Lightning saved a step under in this process (or learned from the step it
restored). A file's ``modified`` time is the step's creation time. Checkpoints
are read through :mod:`ckptd.client.lightning`'s CheckpointIO (or
:meth:`ckptd.client.Client.restore`), not opened as files.

Registered with fsspec as protocol ``ckptd`` (an entry point of the package, so
fsspec finds it without an import); ``fsspec.filesystem("ckptd", socket=...)``
reaches another daemon. Writing a ``ckptd://`` path (torchtitan's stock manager,
DCP's fsspec writer) is refused with the setting that saves through ckptd.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

from ..client import Client
from ..handle import CheckpointInfo

log = logging.getLogger("ckptd.lightning")


class CkptdFileSystem(AbstractFileSystem):  # type: ignore[misc]  # fsspec is untyped
    """The steps of ckptd jobs as read-only files (see the module docstring)."""

    protocol = "ckptd"
    root_marker = ""

    def __init__(self, socket: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.socket = socket
        self._clients: dict[str, Client] = {}

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        text = str(path[0] if isinstance(path, list) else path)
        return text.removeprefix("ckptd://").strip("/")

    # -- the job's view -------------------------------------------------------------
    def _rows(self, job: str) -> dict[int, CheckpointInfo]:
        """The job's restorable steps (its store's client when this process has one)."""
        from .store import STORES

        store = STORES.get(job)
        if store is not None and self.socket is None:
            client = store.client
        else:
            client = self._clients.get(job) or self._clients.setdefault(
                job, Client(job, self.socket)
            )
        # Abandoned steps (left behind by a rollback) are not the job's "latest".
        return {c.step: c for c in client.list() if c.tiers and not c.adopted and not c.abandoned}

    def _names(self, job: str) -> dict[str, int]:
        from .store import STORES

        store = STORES.get(job)
        return dict(store.names) if store is not None else {}

    def _step(self, job: str, rest: str, rows: dict[int, CheckpointInfo]) -> int | None:
        if rest == "latest":
            return max(rows) if rows else None
        if rest.isdigit():
            return int(rest) if int(rest) in rows else None
        step = self._names(job).get(f"ckptd://{job}/{rest}")
        return step if step in rows else None

    # -- fsspec ---------------------------------------------------------------------
    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        """A job is a directory, a step (by number, ``latest`` or name) a file."""
        job, _, rest = self._strip_protocol(path).partition("/")
        if not job:
            return {"name": "", "type": "directory", "size": 0}
        rows = self._rows(job)
        if not rest:
            if rows:
                return {"name": job, "type": "directory", "size": 0}
            raise FileNotFoundError(f"ckptd://{job}: the job has no restorable step")
        step = self._step(job, rest, rows)
        if step is None:
            raise FileNotFoundError(f"ckptd://{job}/{rest}: no such step of job {job!r}")
        row = rows[step]
        return {
            "name": f"{job}/{rest}",
            "type": "file",
            "size": row.size_bytes,
            "created": row.created_unix,
            "step": step,
        }

    def ls(self, path: Any, detail: bool = True, **kwargs: Any) -> list[Any]:
        """A job's steps (``<job>/<step>``) and the names this process knows for them."""
        job, _, rest = self._strip_protocol(path).partition("/")
        if rest or not job:
            entries = [self.info(path)] if rest else []
        else:
            rows = self._rows(job)
            entries = [self.info(f"{job}/{s}") for s in sorted(rows)]
            prefix = f"ckptd://{job}/"
            for name, step in sorted(self._names(job).items()):
                if name.startswith(prefix) and step in rows:
                    entries.append(self.info(name))
        return entries if detail else [e["name"] for e in entries]

    def modified(self, path: Any) -> datetime.datetime:
        """When the step was created (UTC, like fsspec's local files)."""
        created = float(self.info(path).get("created", 0.0))
        return datetime.datetime.fromtimestamp(created, tz=datetime.UTC)

    def created(self, path: Any) -> datetime.datetime:
        """The same as :meth:`modified`: a step is written once."""
        return self.modified(path)

    def makedirs(self, path: Any, exist_ok: bool = False) -> None:
        """Nothing to make: a job exists once it has a step."""

    def mkdir(self, path: Any, create_parents: bool = True, **kwargs: Any) -> None:
        """Nothing to make: a job exists once it has a step."""

    def _open(self, path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        """Reading a step of Lightning's gives the bytes ``torch.save`` would have
        written for its checkpoint dict, so ``Model.load_from_checkpoint(path)`` and
        ``torch.load(fsspec.open(path).open())`` work as with a ``.ckpt`` file.
        Writing is refused with the setting that saves through ckptd."""
        if mode != "rb":
            raise NotImplementedError(
                f"ckptd://{self._strip_protocol(path)} is a ckptd step, not a file to "
                "write: ckptd's steps are saved through shared memory. Lightning: "
                "Trainer(plugins=[ckptd.client.lightning.CkptdCheckpointIO(job)]); "
                "torchtitan: add --override.imports ckptd.client.torchtitan.ckptd_checkpoint; "
                "PyTorch DCP: storage_writer=CkptdWriter(job) / storage_reader=CkptdReader(job); "
                "otherwise ckptd.client.Client.save / restore"
            )
        import io

        import torch

        from .files import read_checkpoint

        job, _, rest = self._strip_protocol(path).partition("/")
        client = self._clients.get(job) or self._clients.setdefault(job, Client(job, self.socket))
        checkpoint = read_checkpoint(client, job, rest, self._names(job), weights_only=True)
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        buf.seek(0)
        return buf


def register() -> None:
    """Make ``ckptd://`` paths reach :class:`CkptdFileSystem` through fsspec."""
    try:
        fsspec.register_implementation("ckptd", CkptdFileSystem, clobber=False)
    except ValueError:  # another ckptd module registered its own first
        log.debug("fsspec protocol 'ckptd' is already registered; keeping it")
