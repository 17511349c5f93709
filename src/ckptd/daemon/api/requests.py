"""Validation of ``CommitShards`` requests into a typed domain object.

Nothing a client sends reaches the filesystem or the shard header before it
passes here: names, dtypes, shapes, indexes, JSON payloads.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import numpy.typing as npt

from ckptd.core.errors import InvalidArgument
from ckptd.core.health import RESERVED_PREFIX
from ckptd.core.manifest import MAX_FILE_BYTES, MAX_WORLD_SIZE, RawJson
from ckptd.core.names import check_name, check_step
from ckptd.core.shard_table import MAX_NDIM, ShardTable
from ckptd.core.shard_wire import decode
from ckptd.proto import ckptd_pb2 as pb

from ..local.liveness import check_holder
from ..local.pending import CommitRequest

MAX_JSON_BYTES = 64 * 2**20
MAX_JSON_DEPTH = 256
"""Deepest nesting of tree_json and metadata_json: a tree spec takes three levels per
level of the saved pytree, and the manifest that holds them must stay far below the
interpreter's recursion limit wherever it is read."""
MAX_SHARDS = 1_000_000
MAX_RANKS = 65536


class CommitParser:
    """:func:`parse_commit` that remembers each (job, rank)'s last shard table and tree
    spec: a training loop commits the same structure at every step, and checking a
    transformer's thousands of shards again was most of the daemon's per-shard work.

    A table (the wire message) or spec text equal to the one checked last time is
    taken as checked: equal bytes, equal verdict. The checked :class:`ShardTable` is
    shared by those commits; nothing changes a table in place.
    """

    def __init__(self, keep: int = 256) -> None:
        self._keep = keep
        self._lock = threading.Lock()  # big commits are parsed on threads
        self._last: OrderedDict[tuple[str, int], tuple[Any, ShardTable, str, Any]] = OrderedDict()

    def known(self, req: pb.CommitShardsRequest) -> tuple[ShardTable | None, Any]:
        """The checked table and tree spec of the last commit of (job, rank), each
        where this request sends the same one (else None)."""
        with self._lock:
            last = self._last.get((req.job, req.rank))
        if last is None or not req.HasField("table") or req.shards:
            return None, None
        msg, table, text, tree = last
        return (table if req.table == msg else None), (tree if req.tree_json == text else None)

    def parse(
        self, req: pb.CommitShardsRequest, known: tuple[ShardTable | None, Any] | None = None
    ) -> CommitRequest:
        """:func:`parse_commit`, reusing what the last commit of (job, rank) checked
        (``known``: :meth:`known` of this request, if asked already)."""
        known_table, known_tree = self.known(req) if known is None else known
        parsed = parse_commit(req, known_table, known_tree)
        key = (req.job, req.rank)
        if req.HasField("table") and not req.shards:
            with self._lock:
                self._last[key] = (req.table, parsed.table, req.tree_json, parsed.tree)
                self._last.move_to_end(key)
                while len(self._last) > self._keep:
                    self._last.popitem(last=False)
        return parsed


def parse_commit(
    req: pb.CommitShardsRequest, table: ShardTable | None = None, tree: Any = None
) -> CommitRequest:
    """Check every field of a commit; raise InvalidArgument naming the bad one.
    ``table``, ``tree``: the request's shard table and tree spec, checked already."""
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
    if req.shards and req.HasField("table"):
        raise InvalidArgument("a commit sends its shards as `shards` or as `table`, not both")
    count = len(req.table.keys) if req.HasField("table") else len(req.shards)
    if count > MAX_SHARDS:
        raise InvalidArgument(f"{count} shards in one commit; the limit is {MAX_SHARDS}")
    if table is None:
        table = decode(req.table) if req.HasField("table") else _from_descriptors(req.shards)
    return CommitRequest(
        lease_id=req.lease_id,
        job=job,
        step=step,
        rank=req.rank,
        node_ranks=node_ranks,
        world_size=world_size,
        data_offset=req.data_offset,
        table=table,
        tree=tree if tree is not None else _tree(req.tree_json),
        metadata=_json("metadata_json", req.metadata_json, {}),
        milestone=req.milestone,
        metrics=check_metrics(req.metrics),
        incremental=req.incremental,
        unchanged_since=req.unchanged_since,
        unchanged=_unchanged(req, len(table)),
        copied_nonce=req.copied_nonce,
        copied_at=req.copied_at,
        copied_holder=_copied_holder(req),
        copied_process=(req.copied_pid, req.copied_started),
        supersede=req.supersede,
    )


def _copied_holder(req: pb.CommitShardsRequest) -> str:
    """The liveness file of a client copying as it commits (it becomes a path)."""
    if req.copied_nonce:
        check_holder(req.copied_holder)
    return req.copied_holder


def _unchanged(req: pb.CommitShardsRequest, rows: int) -> npt.NDArray[np.bool_] | None:
    """The trainer's word that rows of the table did not change since
    ``unchanged_since``: one bit per row (numpy packbits, little bit order)."""
    if not req.unchanged:
        return None
    if req.unchanged_since < 0 or req.unchanged_since >= req.step:
        raise InvalidArgument(
            f"unchanged_since = {req.unchanged_since} must be an earlier step than {req.step}"
        )
    if len(req.unchanged) != (rows + 7) // 8:
        raise InvalidArgument(
            f"unchanged holds {len(req.unchanged)} bytes; {rows} shards need {(rows + 7) // 8}"
        )
    bits = np.unpackbits(np.frombuffer(req.unchanged, np.uint8), bitorder="little")
    return bits[:rows].astype(bool)


def _from_descriptors(shards: Any) -> ShardTable:
    """Shards sent one message each (older clients, journal records they left) as
    the same checked table a client's ``table`` becomes."""
    keys: list[str] = []
    dtypes: list[str] = []
    ndim: list[int] = []
    shape: list[int] = []
    gshape: list[int] = []
    start: list[int] = []
    for sd in shards:
        dims = list(sd.shape)
        whole = list(sd.global_shape) or dims
        where = [(s.start, s.stop) for s in sd.index] or [(0, d) for d in dims]
        if len(dims) > MAX_NDIM or len(whole) != len(dims) or len(where) != len(dims):
            raise InvalidArgument(
                f"shard {sd.key[:80]!r}: shape {dims[:16]}, global_shape {whole[:16]} and "
                f"index {where[:16]} must have one entry per dimension"
            )
        if any(b - a != d for (a, b), d in zip(where, dims, strict=True)):
            raise InvalidArgument(
                f"shard {sd.key[:80]!r}: index {where[:16]} does not place shape {dims[:16]} "
                f"inside global shape {whole[:16]}"
            )
        keys.append(sd.key)
        dtypes.append(sd.dtype)
        ndim.append(len(dims))
        shape += dims
        gshape += whole
        start += [a for a, _ in where]
    table = ShardTable(
        keys,
        dtypes,
        *(
            _ints(v)
            for v in (
                ndim,
                shape,
                gshape,
                start,
                [s.offset for s in shards],
                [s.length for s in shards],
            )
        ),
    )
    table.check(placed=False)
    return table


def _ints(values: list[int]) -> Any:
    """uint64 wire values as int64; 2**62 and above are refused before the cast."""
    if values and max(values) >= MAX_FILE_BYTES:
        raise InvalidArgument(
            "a shape, offset or length of 2**62 or more; no array that large can be stored"
        )
    return np.array(values, np.int64)


def check_metrics(raw: Any) -> dict[str, float]:
    """A save's or adoption's metrics, checked (a name the daemon sets is refused)."""
    if len(raw) > 256:
        raise InvalidArgument(f"{len(raw)} metrics in one save; the limit is 256")
    for name in raw:
        if not name or len(name) > 255:
            raise InvalidArgument(f"metric name {name[:40]!r} must have 1 to 255 characters")
        if name.startswith(RESERVED_PREFIX):
            raise InvalidArgument(
                f"metric {name[:40]!r}: names starting with {RESERVED_PREFIX!r} are set by "
                "the daemon (ckptd.nonfinite: the step's NaN/Inf count); rename it"
            )
    return {str(k): float(v) for k, v in raw.items()}


def _tree(text: str) -> RawJson | None:
    """The tree spec, checked as JSON and then kept as the client's text: the manifest
    carries it as is (re-serialising it cost about a microsecond per leaf)."""
    if _json("tree_json", text, None) is None:
        return None
    return RawJson(text)


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
    except ValueError as exc:  # not JSON, or an integer too long to convert
        raise InvalidArgument(f"{field} is not valid JSON: {exc}") from None
    except RecursionError:  # the parser recursed past the interpreter's limit
        raise too_deep from None
    if default is not None and not isinstance(value, type(default)):
        raise InvalidArgument(f"{field} must be a JSON {type(default).__name__}")
    return value


_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b'[]{}"')))
"""Every byte but brackets and quotes: the only ones that decide nesting."""


def _depth(text: str) -> int:
    """How deeply lists and objects nest in JSON ``text``, counted on the text before
    parsing: escaped backslashes and quotes dropped, then every byte but brackets
    and quotes (a tree spec is ~45 bytes per leaf, ~6 of them structural); each
    remaining quote toggles "inside a string", brackets outside strings summed with
    array operations. About 0.2 us per leaf of a tree spec, not a walk of every node;
    0 when the text has too few brackets to nest past the limit."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return 0  # cannot nest deeper than it has brackets
    plain = text.replace("\\\\", "").replace('\\"', "")
    kept = plain.encode("utf-8", "surrogatepass").translate(None, _NOT_STRUCTURE)
    b = np.frombuffer(kept, np.uint8)
    inside = (np.cumsum(b == ord('"'), dtype=np.int32) & 1) == 1
    step = np.zeros(len(b), np.int8)
    step[(b == ord("[")) | (b == ord("{"))] = 1
    step[(b == ord("]")) | (b == ord("}"))] = -1
    step[inside] = 0
    return int(np.cumsum(step, dtype=np.int32).max(initial=0))
