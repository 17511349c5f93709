"""DeepSpeed saving through ckptd: a checkpoint engine whose files go into the node
daemon's shared memory instead of ``torch.save`` to disk, and a load that finds the
newest step every rank can restore, from the fastest tier (the bucket after a lost
node)::

    import deepspeed
    from ckptd.client import deepspeed as ckptd_deepspeed

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config, ...)
    ckptd_deepspeed.use(engine, "run-42")
    engine.load_checkpoint(ckpt_dir)          # unchanged: the newest step, if any
    ...
    engine.save_checkpoint(ckpt_dir)          # unchanged: returns once handed over

- **Steps.** A checkpoint tag is a step: the number it ends with (DeepSpeed's
  default ``global_step100`` is step 100). Each rank's files of the tag (the model
  states, its ZeRO partition of the optimizer, MoE experts) are that rank's part of
  the step, saved with :mod:`ckptd.client.torch.codec`: tensors are copied into
  shared memory, other values pickled. ``save_checkpoint`` returns once every file
  is in the daemon's memory (``wait="local"``/``"durable"`` waits for more); the
  daemon writes it to disk and the bucket behind the training.
- **The checkpoint directory** keeps DeepSpeed's layout: ``latest`` and, for each
  file, a small reference in its place (:class:`Reference`), which ``torch.load``
  with ``weights_only=False`` (DeepSpeed's own loads, ``zero_to_fp32.py``,
  Universal Checkpointing's ``ds_to_universal.py``) turns into the file's state
  dict, read from the daemon. After a lost node, :func:`use`'s load writes the
  references and ``latest`` back before DeepSpeed looks for them.
- **Which step loads.** ``load_checkpoint(dir)`` without a tag restores the newest
  step every rank can restore (an all-gather over ``torch.distributed``); a step
  the daemon was still writing when the trainer was killed is waited for. With no
  step in ckptd, DeepSpeed's own ``latest`` and files load as before (a run moving
  to ckptd), since the engine reads a plain ``torch.save`` file too.

See docs/integrations/deepspeed.md.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# DeepSpeed ships no type information.
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (  # type: ignore[import-untyped]
    CheckpointCommitInfo,
    CheckpointEngine,
)

from ckptd.core.errors import CheckpointNotFound, CkptdError, InvalidArgument

from .client import Client
from .distributed import agree_on_step
from .handle import SaveHandle
from .torch.codec import FORMAT, MapLocation, decode, encode
from .torch.common import ClientSource, world

log = logging.getLogger("ckptd.deepspeed")

KEY = "deepspeed"
"""Where the step's metadata keeps this integration's record."""
IN_FLIGHT_TIMEOUT = 300.0
"""Longest wait for an acknowledged step still being written before choosing one."""
_TAG_STEP = re.compile(r"(\d+)$")


def step_of_tag(tag: object) -> int:
    """The ckptd step of a DeepSpeed checkpoint tag: the number it ends with."""
    match = _TAG_STEP.search(str(tag))
    if match is None:
        raise InvalidArgument(
            f"checkpoint tag {tag!r}: ckptd takes the step from the tag, which must end "
            "with it (DeepSpeed's default global_step100, or tag=f'step{n}')"
        )
    return int(match.group(1))


class Reference:
    """What lies in the checkpoint directory in place of one of DeepSpeed's files: the
    job, step, rank and index of the file in that rank's part. Unpickled (by
    ``torch.load(path, weights_only=False)``), it is the file's state dict, read from
    the node's daemon."""

    def __init__(self, job: str, step: int, rank: int, index: int, name: str) -> None:
        self.job, self.step, self.rank, self.index, self.name = job, step, rank, index, name

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return resolve, (self.job, self.step, self.rank, self.index, self.name)

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the reference at ``path``, whole or not at all."""
        tmp = f"{os.fspath(path)}.{os.getpid()}.{threading.get_ident()}.tmp"
        torch.save(self, tmp)
        os.replace(tmp, path)


class _Loads(threading.local):
    """The engine loading now in this thread (its client, cache and map_location)."""

    engine: CkptdCheckpointEngine | None = None
    map_location: MapLocation = None


_LOADS = _Loads()


def resolve(job: str, step: int, rank: int, index: int, name: str) -> dict[str, Any]:
    """The state dict of a file a :class:`Reference` names (see the module): through
    the engine loading in this thread, else a client of the node's daemon (its
    socket from ``CKPTD_SOCKET`` or the default)."""
    engine = _LOADS.engine
    if engine is not None and engine.job == job:
        return engine.read(step, rank, index, name, _LOADS.map_location)
    client = Client(job)
    try:
        tree, meta = client.restore(step=step, rank=rank)
        return _file_of(tree, meta, index, name, f"step {step} of job {job!r}", None)
    finally:
        client.close()


def _file_of(
    tree: Any, meta: Any, index: int, name: str, where: str, map_location: MapLocation
) -> dict[str, Any]:
    names = tree.get("names") if isinstance(tree, dict) and _record(meta) else None
    if not isinstance(names, list) or index >= len(names) or names[index] != name:
        raise CheckpointNotFound(f"{where} holds no DeepSpeed file {name!r}")
    return decode(tree["files"][index], tree["replace"][index], False, map_location)


class CkptdCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """DeepSpeed's checkpoint engine over ckptd (see the module). ``job`` or
    ``client`` (a :class:`~ckptd.client.Client` whose rank is this process's global
    rank); ``socket``, ``client_options``: for the client made from ``job``;
    ``wait``: what ``save_checkpoint`` waits for before it returns, None (the
    daemon holds the files), ``"local"`` or ``"durable"``."""

    def __init__(
        self,
        job: str | None = None,
        *,
        client: Client | None = None,
        socket: str | os.PathLike[str] | None = None,
        client_options: dict[str, Any] | None = None,
        wait: str | None = None,
    ) -> None:
        super().__init__(None)
        if (job is None) == (client is None):
            raise TypeError("give the job's name (use(engine, 'run-42')) or a client=")
        if wait not in (None, "local", "durable"):
            raise InvalidArgument(f"wait must be None, 'local' or 'durable', not {wait!r}")
        self.name = "CkptdCheckpointEngine"
        self.wait = wait
        self._source = ClientSource(client if client is not None else str(job), socket,
                                    None, dict(client_options or {}))  # fmt: skip
        self._tag: str | None = None
        self._dir = ""
        self._files: list[tuple[str, Any]] = []
        self._restored: dict[tuple[int, int], tuple[Any, Any]] = {}

    @property
    def job(self) -> str:
        """The ckptd job the steps are saved to."""
        return str(self._source.job)

    @property
    def client(self) -> Client:
        """This process's client (rank: its global rank)."""
        return self._source.get(world()[0])

    # -- save -----------------------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        """A checkpoint begins: its tag names the step (checked now, before any file)."""
        step_of_tag(info.tag)
        self._tag, self._dir, self._files = str(info.tag), str(info.save_dir), []

    def save(self, state_dict: Any, path: str) -> None:
        """Keep one of the tag's files for the commit (DeepSpeed builds every file of
        the checkpoint before it commits, and changes no tensor in between)."""
        if self._tag is None:
            raise InvalidArgument("save() before create(): call engine.save_checkpoint")
        self._files.append((self._name(path), state_dict))

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Hand this rank's files to the daemon as its part of the step, then put a
        reference in place of each file. Every rank commits (one with no file hands an
        empty part, so the step is complete)."""
        tag, step = str(info.tag), step_of_tag(info.tag)
        names = [n for n, _ in self._files]
        encoded = [encode(sd) for _, sd in self._files]
        rank = world()[0]
        # The step's metadata is one for every rank: each rank's own record is in its tree.
        part = {
            "files": [t for t, _ in encoded],
            "names": names,
            "replace": [r for _, r in encoded],
            "ranks": _gather_names(names, rank),
        }
        handle = self.client.save(step, part, {KEY: {"format": FORMAT, "tag": tag}})
        self._files, self._tag = [], None  # the daemon holds the bytes now
        folder = Path(info.save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        for index, name in enumerate(names):
            Reference(self.job, step, rank, index, name).write(folder / name)
        if self.wait is not None:
            handle.wait(self.wait)
        return True

    def preserves_storage_sharing(self) -> bool:
        """False: each tensor is copied as itself, so DeepSpeed need not clone views of
        its flat buffers first (what it does for ``torch.save``, which would write the
        whole buffer under each view)."""
        return False

    def _name(self, path: str) -> str:
        folder = os.path.join(self._dir, str(self._tag))
        rel = os.path.relpath(path, folder)
        if rel.startswith(os.pardir):
            raise InvalidArgument(f"{path!r} is not inside the checkpoint folder {folder!r}")
        return rel

    # -- load -----------------------------------------------------------------------
    def load(self, path: str, map_location: MapLocation = None) -> Any:
        """What ``torch.load`` of ``path`` gives: a reference resolved through this
        engine's client, or a plain ``torch.save`` file (a run moving to ckptd)."""
        before = _LOADS.engine, _LOADS.map_location
        _LOADS.engine, _LOADS.map_location = self, map_location
        try:
            return torch.load(path, map_location=map_location, weights_only=False)
        finally:
            _LOADS.engine, _LOADS.map_location = before

    def read(
        self, step: int, rank: int, index: int, name: str, where: MapLocation
    ) -> dict[str, Any]:
        """File ``index`` of ``rank``'s part of ``step``, mapped to ``where``."""
        tree, meta = self.read_part(step, rank)
        return _file_of(tree, meta, index, name, f"step {step} of job {self.job!r}", where)

    def prepare(self, load_dir: str | os.PathLike[str]) -> str | None:
        """The tag of the newest step every rank can restore, its references and
        ``latest`` written into ``load_dir``; None if the job has no step (a collective
        when the job has several processes)."""
        client = self.client
        _wait_in_flight(client)
        rank, size = world()
        step = agree_on_step(client) if size > 1 else client.latest_step()
        if step is None:
            return None
        own, meta = self.read_part(step, rank)
        record = _record(meta)
        if record is None:
            raise InvalidArgument(
                f"step {step} of job {self.job!r} was not saved by ckptd's DeepSpeed engine; "
                "restore it with ckptd.client.Client.restore"
            )
        tag = str(record["tag"])
        folder = Path(load_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        for index, name in enumerate(own["names"]):
            Reference(self.job, step, rank, index, name).write(folder / name)
        _barrier()
        if os.environ.get("LOCAL_RANK", str(rank)) == "0":  # each node's first process
            everyone = self.read_part(step, 0)[0].get("ranks") or {}
            for name, (owner, index) in everyone.items():
                if not (folder / name).exists():
                    Reference(self.job, step, int(owner), int(index), name).write(folder / name)
            _write_whole(Path(load_dir) / "latest", tag)
        _barrier()
        log.info("loading step %d (tag %s) of job %r", step, tag, self.job)
        return tag

    def read_part(self, step: int, rank: int) -> tuple[Any, Any]:
        """``rank``'s part of ``step``, restored once per ``load_checkpoint``."""
        key = (step, rank)
        if key not in self._restored:
            self._restored[key] = self.client.restore(step=step, rank=rank)
        return self._restored[key]

    def forget(self) -> None:
        """Drop the parts restored for a load (DeepSpeed copied what it needed)."""
        self._restored.clear()


def use(
    engine: Any,
    job: str | None = None,
    *,
    client: Client | None = None,
    socket: str | os.PathLike[str] | None = None,
    client_options: dict[str, Any] | None = None,
    wait: str | None = None,
) -> CkptdCheckpointEngine:
    """Make ``engine`` (what ``deepspeed.initialize`` returned) save and load through
    ckptd as ``job``: its checkpoint engine is replaced, and its ``load_checkpoint``
    without a tag loads the newest step every rank can restore (see the module).
    Call it on every rank, right after ``deepspeed.initialize``."""
    ckpt = CkptdCheckpointEngine(
        job, client=client, socket=socket, client_options=client_options, wait=wait
    )
    engine.checkpoint_engine = ckpt
    original = engine.load_checkpoint

    @functools.wraps(original)
    def load_checkpoint(load_dir: Any, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        try:
            if tag is None:
                tag = ckpt.prepare(load_dir)
            return original(load_dir, tag, *args, **kwargs)
        finally:
            ckpt.forget()

    engine.load_checkpoint = load_checkpoint
    return ckpt


# -- helpers ---------------------------------------------------------------------
def _record(meta: Any) -> dict[str, Any] | None:
    """This integration's record in a step's metadata (None: another saved the step)."""
    record = meta.get(KEY) if isinstance(meta, dict) else None
    return record if isinstance(record, dict) and "tag" in record else None


def _gather_names(names: list[str], rank: int) -> dict[str, list[int]] | None:
    """Rank 0's record of every rank's files (``{name: [rank, index]}``: what a node
    needs to put every reference back); None on the other ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return {n: [rank, i] for i, n in enumerate(names)}
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(names, gathered, dst=0)
    if gathered is None:
        return None
    return {n: [r, i] for r, ns in enumerate(gathered) for i, n in enumerate(ns or [])}


def _wait_in_flight(client: Client) -> None:
    for row in client.list():
        if row.state == "STAGING":
            try:
                SaveHandle(client, row.step).wait("local", IN_FLIGHT_TIMEOUT)
            except (CkptdError, TimeoutError) as exc:  # not restorable: not a candidate
                log.info("step %d of job %r is not restorable: %s", row.step, client.job, exc)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


__all__ = ["CkptdCheckpointEngine", "Reference", "resolve", "step_of_tag", "use"]
