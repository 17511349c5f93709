"""What the DCP writer and reader share: checkpoint ids, the client, the metadata codec.

A checkpoint id names a ckptd step: the int ``N``, the string ``"N"``,
``"ckptd://<job>/<N>"`` or ``"ckptd://<job>/step-<N>"`` (the job must be the writer's
or reader's own), or a path whose last part is ``step-<N>`` (torchtitan's
``<folder>/step-<N>``: the step of the storage's job; the folder names no storage).
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ckptd.core.errors import CheckpointCorrupt, InvalidArgument

from ..client import Client

SCHEME = "ckptd://"
ITEMS = "items"
"""Tree key of a rank's write items ({item key: array})."""
METADATA = "dcp_metadata"
"""Tree key of the pickled DCP ``Metadata`` (a uint8 array, so crc32c covers it) in
the coordinator's part."""
FORMAT = 1
"""Version of this layout, recorded in the step's JSON metadata under ``"dcp"``."""
COORDINATOR = 0
"""DCP's coordinator is rank 0 of the process group (``_save_state_dict``'s default)."""

_URL = re.compile(r"ckptd://([^/]+)/(?:step-)?(\d+)/?")
_STEP_DIR = re.compile(r"(?:.*/)?step-(\d+)/?")


def parse_checkpoint_id(checkpoint_id: object, job: str) -> int:
    """The step named by ``checkpoint_id`` for ``job``; raises InvalidArgument."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        step = checkpoint_id
    elif isinstance(checkpoint_id, str | os.PathLike):
        text = os.fspath(checkpoint_id)
        m = _URL.fullmatch(text) if isinstance(text, str) else None
        d = _STEP_DIR.fullmatch(text) if isinstance(text, str) and "://" not in text else None
        if m is not None:
            if m.group(1) != job:
                raise InvalidArgument(
                    f"checkpoint_id {text!r} names job {m.group(1)!r}, but this storage "
                    f"reads and writes job {job!r}"
                )
            step = int(m.group(2))
        elif isinstance(text, str) and text.isdigit():
            step = int(text)
        elif d is not None:
            step = int(d.group(1))
        else:
            raise InvalidArgument(
                f"checkpoint_id {text!r} is not a ckptd step: use an int step, '<step>', "
                f"'{SCHEME}<job>/<step>' or a path ending in 'step-<step>'"
            )
    else:
        raise InvalidArgument(
            f"checkpoint_id must be a step (int) or '{SCHEME}<job>/<step>', not {checkpoint_id!r}"
        )
    if step < 0:
        raise InvalidArgument(f"checkpoint_id {checkpoint_id!r}: steps are non-negative")
    return step


def is_checkpoint_id(checkpoint_id: object) -> bool:
    """Whether ``checkpoint_id`` is a ckptd URL or a step number (a path ending in
    ``step-<N>`` is accepted by ``reset``, but it names a filesystem's directory)."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        return checkpoint_id >= 0
    return isinstance(checkpoint_id, str) and _URL.fullmatch(checkpoint_id) is not None


def checkpoint_url(job: str, step: int | None) -> str | None:
    """``ckptd://<job>/<step>`` (None while no step is set)."""
    return None if step is None else f"{SCHEME}{job}/{step}"


def item_key(index: MetadataIndex, shard: bool) -> str:
    """A write item's key within its rank: its fqn, plus the chunk offset for shards
    (a rank may hold several chunks of one tensor)."""
    if index.offset is None or not shard:
        return index.fqn
    return f"{index.fqn}@{','.join(map(str, index.offset))}"


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def node_ranks_for(rank: int, world_size: int) -> list[int]:
    """Ranks saving to this node's daemon: torchrun's block of ``LOCAL_WORLD_SIZE``
    ranks around ``rank`` when the job spans nodes, else every rank."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    local_rank = os.environ.get("LOCAL_RANK")
    if local and local_rank and local.isdigit() and local_rank.isdigit():
        n, lr = int(local), int(local_rank)
        if 0 < n < world_size and lr < n:
            return list(range(rank - lr, rank - lr + n))
    return list(range(world_size))


class ClientSource:
    """A ckptd :class:`Client` given by the caller, or made on first use from the job
    and socket (then picklable: DCP's process executor ships the writer to a
    subprocess, which makes its own client)."""

    def __init__(
        self,
        client_or_job: Client | str,
        socket: str | os.PathLike[str] | None,
        node_ranks: list[int] | None,
        options: dict[str, Any],
    ) -> None:
        if isinstance(client_or_job, Client):
            self.job = client_or_job.job
            self._client: Client | None = client_or_job
            self._owned = False
        elif isinstance(client_or_job, str) and client_or_job:
            self.job = client_or_job
            self._client = None
            self._owned = True
        else:
            raise InvalidArgument(
                f"pass a ckptd.client.Client or a job name, not {client_or_job!r}"
            )
        self.socket = socket
        self.node_ranks = node_ranks
        self.options = options

    def get(self, rank: int, check: bool = True) -> Client:
        """The client, checked (or made) for DCP rank ``rank`` (``check=False``: a
        reader's client, whose rank does not matter, is not checked)."""
        if self._client is None:
            _, size = world()
            size = max(size, rank + 1)
            ranks = self.node_ranks or node_ranks_for(rank, size)
            self._client = Client(
                self.job,
                self.socket,
                rank=rank,
                node_ranks=ranks,
                world_size=size,
                **{"supersede": False, **self.options},  # DCP's every checkpoint_id
            )
        elif check and self._client.rank != rank:
            raise InvalidArgument(
                f"the ckptd Client has rank {self._client.rank} but DCP runs this process as "
                f"rank {rank}: make the client with rank=dist.get_rank()"
            )
        return self._client

    def close(self) -> None:
        """Close the client if this made it."""
        if self._client is not None and self._owned:
            self._client.close()
            self._client = None

    def __getstate__(self) -> dict[str, Any]:
        if not self._owned:
            raise TypeError(
                "a DCP storage made from a ckptd Client cannot be pickled (DCP's process "
                "executor does): make it from the job name instead"
            )
        return {**self.__dict__, "_client": None}


def encode_metadata(metadata: Metadata) -> np.ndarray:
    """DCP's metadata as the uint8 array stored in the coordinator's part."""
    return np.frombuffer(pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)


def decode_metadata(arr: np.ndarray, where: str) -> Metadata:
    """Inverse of :func:`encode_metadata`. Only DCP's metadata classes, torch's
    dtypes/sizes and plain containers unpickle: a checkpoint is data, not code."""
    try:
        md = _Unpickler(io.BytesIO(arr.tobytes())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError) as exc:
        raise CheckpointCorrupt(f"{where}: the DCP metadata cannot be read: {exc}") from None
    if not isinstance(md, Metadata):
        raise CheckpointCorrupt(f"{where}: the DCP metadata is a {type(md).__name__}")
    return md


_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch.strided etc. by name
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")
