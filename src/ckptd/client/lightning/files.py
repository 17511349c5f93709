"""A Lightning step of ckptd read back as the checkpoint dict, outside a Trainer: what
``Model.load_from_checkpoint("ckptd://<job>/<name>")`` (through the ``ckptd://``
filesystem, fs.py) and :func:`load_checkpoint` (in place of ``torch.load``) use.

A name (``best_model_path``, ``last.ckpt``) is looked up in the names this process
saved under, else in the record of names the job's newest Lightning step carries
(store.py: each save records every name Lightning still refers to), so a fresh
process that evaluates or serves ``checkpoint_callback.best_model_path`` finds it.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from ckptd.core.errors import CheckpointNotFound, InvalidArgument

from ..client import Client
from ..torch.codec import MapLocation, decode
from .store import LATEST, METRIC, SCHEME, STORES, split_url


def read_checkpoint(
    client: Client,
    job: str,
    rest: str,
    names: dict[str, int],
    weights_only: bool | None = None,
    map_location: MapLocation = None,
) -> dict[str, Any]:
    """The checkpoint dict of ``ckptd://<job>/<rest>`` (``latest``, a step number or a
    name), restored from the fastest tier holding it (rank 0: Lightning's saves)."""
    url = f"{SCHEME}{job}/{rest}"
    step: int | None = None
    if rest.isdigit():
        step = int(rest)
    elif rest not in ("", LATEST):
        step = names.get(url)
        if step is None:
            step = _named_by_newest(client, url)
    tree, meta = client.restore(step=step, rank=0)
    lmeta = meta.get("lightning") if isinstance(meta, dict) else None
    if not isinstance(lmeta, dict) or "replace" not in lmeta:
        raise InvalidArgument(
            f"{url}: that step of job {job!r} was not saved by ckptd's Lightning "
            "integration; restore it with ckptd.client.Client.restore"
        )
    try:
        return decode(tree, lmeta["replace"], weights_only, map_location)
    except pickle.UnpicklingError as exc:
        raise pickle.UnpicklingError(
            f"{url} holds values torch.load(weights_only=True) refuses ({exc}). If you "
            "trust the checkpoint, load it with ckptd.client.lightning.load_checkpoint("
            f"{url!r}, weights_only=False) and pass the dict on (e.g. "
            "model.load_state_dict(ckpt['state_dict']))"
        ) from None


def _named_by_newest(client: Client, url: str) -> int:
    """The step ``url`` names in the newest Lightning step's record of names."""
    rows = [c for c in client.list() if c.tiers and not c.adopted and not c.abandoned]
    ours = [c.step for c in rows if (c.metrics or {}).get(METRIC) == 1.0] or [c.step for c in rows]
    if ours:
        _, meta = client.restore(step=max(ours), rank=0)
        lmeta = meta.get("lightning") if isinstance(meta, dict) else None
        saved = lmeta.get("names") if isinstance(lmeta, dict) else None
        step = saved.get(url) if isinstance(saved, dict) else None
        if isinstance(step, int):
            return step
    raise CheckpointNotFound(
        f"{url} is not a checkpoint name job {client.job!r} still holds (its newest "
        f"Lightning step records the names Lightning kept); use '{SCHEME}{client.job}/"
        f"latest' or '{SCHEME}{client.job}/<step>' (`ckptd ls {client.job}` lists the steps)"
    )


def load_checkpoint(
    path: str | os.PathLike[str],
    map_location: MapLocation = None,
    weights_only: bool | None = None,
    socket: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """``torch.load`` for a ``ckptd://<job>/...`` path: the checkpoint dict Lightning
    saved (``ckptd://<job>/latest``, ``/<step>`` or a name such as
    ``trainer.checkpoint_callback.best_model_path``), tensors on the CPU unless
    ``map_location`` says otherwise, pickled values read with ``weights_only`` as
    ``torch.load`` would. ``socket``: the daemon's (default as ``Client``'s)."""
    url = split_url(os.fspath(path))
    if url is None:
        raise InvalidArgument(
            f"{os.fspath(path)!r} is not a ckptd path; load_checkpoint takes "
            "'ckptd://<job>/latest', 'ckptd://<job>/<step>' or a name Lightning saved under "
            "(use torch.load for a file)"
        )
    job, rest = url
    store = STORES.get(job)
    names = dict(store.names) if store is not None else {}
    with Client(job, socket) as client:
        return read_checkpoint(client, job, rest, names, weights_only, map_location)


__all__ = ["load_checkpoint", "read_checkpoint"]
