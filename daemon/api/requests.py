"""Validation of ``CommitShards`` requests into a typed domain object.

Nothing a client sends reaches the filesystem or the shard header before it
passes here: names, dtypes, shapes, indexes, JSON payloads.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from ckptd.core.errors import InvalidArgument
from ckptd.core.format import TensorEntry, str_to_dtype
from ckptd.core.manifest import MAX_FILE_BYTES, MAX_WORLD_SIZE
from ckptd.core.names import check_name, check_shard_key, check_step
from ckptd.proto import ckptd_pb2 as pb

from ..local.saver import CommitRequest

MAX_JSON_BYTES = 64 * 2**20
MAX_JSON_DEPTH = 256
"""Deepest nesting of tree_json and metadata_json: a tree spec takes three levels per
level of the saved pytree, and the manifest that holds them must stay far below the
interpreter's recursion limit wherever it is read."""
MAX_SHARDS = 1_000_000
MAX_RANKS = 65536
MAX_NDIM = 64


def parse_commit(req: pb.CommitShardsRequest) -> CommitRequest:
    """Check every field of a commit; raise InvalidArgument naming the bad one."""
    job = check_name("job", req.job)
    step = check_step(req.step)
    node_ranks = tuple(sorted(req.node_ranks)) or (req.rank,)
    if len(set(node_ranks)) != len(node_ranks) or len(node_ranks) > MAX_RANKS:
        raise InvalidArgument(
            f"node_ranks {list(req.node_ranks)[:16]} has duplicates or is too long"
        )
    if req.rank not in node_ranks:
        raise InvalidArgument(f"rank {req.rank} is not in node_ranks {list(node_ranks)[:16]}")
    world_size = req.world_size or max(node_ranks) + 1
    if world_size <= max(node_ranks):
        raise InvalidArgument(
            f"world_size {world_size} must exceed every rank (max {max(node_ranks)})"
        )
    if world_size > MAX_WORLD_SIZE:  # the manifest check refuses it when read back
        raise InvalidArgument(
            f"world_size {world_size} is above the {MAX_WORLD_SIZE} processes a checkpoint "
            "may have; send the number of processes that save"
        )
    if len(req.shards) > MAX_SHARDS:
        raise InvalidArgument(f"{len(req.shards)} shards in one commit; the limit is {MAX_SHARDS}")
    entries: list[TensorEntry] = []
    dtype_names: dict[str, str] = {}
    global_shapes: dict[str, tuple[int, ...]] = {}
    indexes: dict[str, list[tuple[int, int]]] = {}
    for sd in req.shards:
        key = check_shard_key(sd.key)
        if key in dtype_names:
            raise InvalidArgument(
                f"duplicate shard key {key!r}; every shard of a rank needs its own key"
            )
        try:
            dt = str_to_dtype(sd.dtype)
        except ValueError as exc:
            raise InvalidArgument(
                f"shard {key!r}: {exc}; use a numpy dtype string (np.dtype(x).str, e.g. '<f4') "
                "or an ml_dtypes name such as 'bfloat16'"
            ) from None
        shape = tuple(int(d) for d in sd.shape)
        gshape = tuple(int(d) for d in sd.global_shape) or shape
        if any(d >= MAX_FILE_BYTES for d in (*shape, *gshape)):
            raise InvalidArgument(
                f"shard {key!r}: shape {list(shape)} or global shape {list(gshape)} has a "
                "dimension of 2**62 or more; no array that large can be stored"
            )
        if len(shape) > MAX_NDIM or len(gshape) != len(shape):
            raise InvalidArgument(
                f"shard {key!r}: global_shape {list(gshape)} does not match shape {list(shape)}"
            )
        index = [(int(s.start), int(s.stop)) for s in sd.index] or [(0, d) for d in shape]
        if len(index) != len(shape) or any(
            not (0 <= a <= b <= g) or b - a != d
            for (a, b), d, g in zip(index, shape, gshape, strict=False)
        ):
            raise InvalidArgument(
                f"shard {key!r}: index {index} does not place shape {list(shape)} inside "
                f"global shape {list(gshape)}"
            )
        if math.prod(shape) * dt.itemsize != sd.length:
            raise InvalidArgument(
                f"shard {key!r}: length {sd.length} != {math.prod(shape) * dt.itemsize} bytes "
                f"for shape {list(shape)} of {sd.dtype}"
            )
        entries.append(TensorEntry(key, dt, shape, int(sd.offset), int(sd.length)))
        dtype_names[key] = sd.dtype
        global_shapes[key] = gshape
        indexes[key] = index
    return CommitRequest(
        lease_id=req.lease_id,
        job=job,
        step=step,
        rank=req.rank,
        node_ranks=node_ranks,
        world_size=world_size,
        data_offset=req.data_offset,
        entries=entries,
        dtype_names=dtype_names,
        global_shapes=global_shapes,
        indexes=indexes,
        tree=_json("tree_json", req.tree_json, None),
        metadata=_json("metadata_json", req.metadata_json, {}),
        milestone=req.milestone,
        metrics=_metrics(req.metrics),
    )


def _metrics(raw: Any) -> dict[str, float]:
    if len(raw) > 256:
        raise InvalidArgument(f"{len(raw)} metrics in one save; the limit is 256")
    for name in raw:
        if not name or len(name) > 255:
            raise InvalidArgument(f"metric name {name[:40]!r} must have 1 to 255 characters")
    return {str(k): float(v) for k, v in raw.items()}


def _json(field: str, text: str, default: Any) -> Any:
    if not text:
        return default
    if len(text) > MAX_JSON_BYTES:
        raise InvalidArgument(f"{field} is {len(text)} bytes; the limit is {MAX_JSON_BYTES}")
    too_deep = InvalidArgument(
        f"{field} nests deeper than {MAX_JSON_DEPTH} levels; flatten the structure"
    )
    if _depth(text) > MAX_JSON_DEPTH:
        raise too_deep
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{field} is not valid JSON: {exc}") from None
    except RecursionError:  # the parser recursed past the interpreter's limit
        raise too_deep from None
    if default is not None and not isinstance(value, type(default)):
        raise InvalidArgument(f"{field} must be a JSON {type(default).__name__}")
    return value


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _depth(text: str) -> int:
    """How deeply lists and objects nest in JSON ``text``, counted on the text before
    parsing: strings removed (a regex), then a running sum of brackets (numpy), so a
    commit of thousands of arrays pays microseconds, not a walk of every node (0 when
    the text has too few brackets to nest past the limit)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return 0  # cannot nest deeper than it has brackets
    brackets = np.frombuffer(_STRING.sub("", text).encode(), np.uint8)
    step = np.zeros(len(brackets), np.int32)
    step[(brackets == ord("[")) | (brackets == ord("{"))] = 1
    step[(brackets == ord("]")) | (brackets == ord("}"))] = -1
    return int(np.cumsum(step).max(initial=0))
