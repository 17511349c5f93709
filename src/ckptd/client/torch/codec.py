"""A PyTorch checkpoint dict (Lightning's, DeepSpeed's files) <-> a ckptd tree and
JSON metadata, faithfully.

A checkpoint dict holds tensors (the model's state dict, optimizer moments,
callbacks' scores) and small Python values (epoch, global step, loops' progress,
hyperparameters, callbacks' paths, a framework's config). The tree handed to
:meth:`ckptd.client.Client.save` keeps its shape, so each tensor is one shard
named by its path (``checkpoint.state_dict.layer.weight``,
``checkpoint.optimizer_states.0.state.0.exp_avg``) and the JSON-like values
(None, bool, int, float, str in dicts with str or int keys, lists and tuples)
stay in the tree's spec.

Whatever the tree cannot hold exactly is written with ``torch.save`` into a
uint8 array (so crc32c covers it too) and put back when loading, with
``torch.load`` and the ``weights_only`` Lightning asked for:

- a value of any other type (a ``Namespace``, an enum, a set, bytes, a
  NamedTuple, a dict with other keys): the whole value;
- a dict subclass (the model's ``OrderedDict`` state dict, with its ``_metadata``
  attribute of module versions that ``load_state_dict`` reads): its items go in
  the tree like a dict's, and an empty copy of it (its type and attributes) is
  pickled, to be refilled with the loaded items.

Where each one goes is listed in the metadata (``replace``: path, blob index,
kind), so loading rebuilds only the containers on those paths.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ckptd.core.errors import InvalidArgument

FORMAT = 1
"""Version of this layout, recorded in the step's metadata by each integration."""
TREE = "checkpoint"
"""Tree key of the checkpoint dict."""
BLOBS = "pickled"
"""Tree key of the list of pickled values (uint8 arrays)."""
VALUE = "value"
"""A replacement that is the whole value at its path."""
SHELL = "shell"
"""A replacement that is an empty dict subclass, refilled with the items at its path."""

Path = tuple[str | int, ...]
MapLocation = Any
"""What ``torch.load`` takes as ``map_location``: None, a device, a str, a dict or a function."""

_SCALARS = (type(None), bool, int, float, str)


def encode(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], list[list[Any]]]:
    """``(tree, replace)``: the tree for ``Client.save`` and the replacement list to
    record in the metadata (``[[path, blob index, kind], ...]``)."""
    if not isinstance(checkpoint, dict):
        raise InvalidArgument(
            f"a checkpoint is a dict, not {type(checkpoint).__name__}; "
            "save what the framework's checkpointing hands over (Lightning's "
            "Trainer.save_checkpoint, DeepSpeed's save_checkpoint)"
        )
    blobs: list[np.ndarray] = []
    replace: list[list[Any]] = []

    def pickle_at(node: Any, path: Path, kind: str) -> None:
        replace.append([list(path), len(blobs), kind])
        blobs.append(_dumps(node, path))

    def walk(node: Any, path: Path) -> Any:
        t = type(node)
        if t in _SCALARS:
            return node
        if isinstance(node, torch.Tensor):
            return node
        if isinstance(node, dict):
            if not all(_key_ok(k) for k in node):
                pickle_at(node, path, VALUE)  # the tree's dicts hold str and int keys
                return None
            if t is not dict:
                shell = _shell(node)
                if shell is None:
                    pickle_at(node, path, VALUE)
                    return None
                pickle_at(shell, path, SHELL)
            return {k: walk(v, (*path, k)) for k, v in node.items()}
        if t is list:
            return [walk(v, (*path, i)) for i, v in enumerate(node)]
        if t is tuple:
            return tuple(walk(v, (*path, i)) for i, v in enumerate(node))
        if (t is np.ndarray or isinstance(node, np.generic)) and not node.dtype.hasobject:
            return node
        pickle_at(node, path, VALUE)
        return None

    tree = {TREE: walk(checkpoint, ()), BLOBS: blobs}
    return tree, replace


def decode(
    tree: dict[str, Any],
    replace: list[list[Any]],
    weights_only: bool | None = None,
    map_location: MapLocation = None,
) -> dict[str, Any]:
    """The checkpoint dict :func:`encode` split up, rebuilt from a restored ``tree``."""
    blobs = tree.get(BLOBS) or []
    todo: dict[Path, tuple[int, str]] = {}
    above: set[Path] = set()  # every proper prefix of a replaced path
    for path, index, kind in replace:
        p = tuple(path)
        todo[p] = (int(index), str(kind))
        above.update(p[:i] for i in range(len(p)))

    def load(index: int) -> Any:
        data = np.asarray(blobs[index], dtype=np.uint8)
        return torch.load(io.BytesIO(data.tobytes()), weights_only=weights_only)

    def rebuild(node: Any, path: Path) -> Any:
        hit = todo.get(path)
        if hit is not None and hit[1] == VALUE:
            return load(hit[0])
        if path in above or hit is not None:
            if isinstance(node, dict):
                node = {k: rebuild(v, (*path, k)) for k, v in node.items()}
            elif isinstance(node, list | tuple):
                node = type(node)(rebuild(v, (*path, i)) for i, v in enumerate(node))
        if hit is not None:  # a dict subclass: its own type and attributes, these items
            shell = load(hit[0])
            shell.update(node)
            return shell
        return node

    checkpoint = rebuild(tree[TREE], ())
    if map_location is not None:
        checkpoint = _relocate(checkpoint, _location_fn(map_location))
    if not isinstance(checkpoint, dict):
        raise InvalidArgument("the restored step does not hold a checkpoint dict")
    return checkpoint


# -- helpers ---------------------------------------------------------------------
def _key_ok(k: object) -> bool:
    return type(k) is str or type(k) is int


def _shell(node: dict[Any, Any]) -> dict[Any, Any] | None:
    """An empty copy of a dict subclass with its attributes (None if it cannot be made)."""
    try:
        shell = copy.copy(node)
        shell.clear()
    except Exception:
        return None
    return shell if type(shell) is type(node) and not shell else None


def _dumps(node: Any, path: Path) -> np.ndarray:
    buf = io.BytesIO()
    try:
        torch.save(node, buf)
    except Exception as exc:
        where = "".join(f"[{p!r}]" for p in path) or "<root>"
        raise InvalidArgument(
            f"the checkpoint's value at {where} ({type(node).__name__}) cannot be "
            f"saved: torch.save refused it: {exc}"
        ) from exc
    return np.frombuffer(buf.getbuffer(), dtype=np.uint8).copy()


def _location_fn(map_location: MapLocation) -> Callable[[torch.Tensor], torch.Tensor]:
    """``map_location`` as ``torch.load`` reads it, for tensors restored on the CPU."""
    if callable(map_location):

        def by_fn(t: torch.Tensor) -> torch.Tensor:
            storage = map_location(t.untyped_storage(), "cpu")
            device = getattr(storage, "device", t.device)
            return t if device == t.device else t.to(device)

        return by_fn
    if isinstance(map_location, dict):
        target = map_location.get("cpu", "cpu")
        return lambda t: t.to(target)
    if isinstance(map_location, str | torch.device):
        return lambda t: t.to(map_location)
    raise InvalidArgument(
        f"map_location {map_location!r} is not a device, a str, a dict or a function"
    )


def _relocate(node: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        return fn(node)
    if isinstance(node, dict):
        for k, v in node.items():
            node[k] = _relocate(v, fn)  # in place: a dict subclass keeps its type
        return node
    if isinstance(node, list):
        return [_relocate(v, fn) for v in node]
    if type(node) is tuple:
        return tuple(_relocate(v, fn) for v in node)
    return node
