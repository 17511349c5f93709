"""Hypothesis strategies for ckptd requests, built from the protobuf descriptors.

Every RPC of the ``Ckptd`` service is found in the service descriptor, and its
request message is generated field by field from the message descriptor: strings,
integers of each width, doubles, enums (unknown values too), bools, bytes,
repeated fields, nested messages and maps. Each field has a *valid-looking*
strategy (a job the daemon knows, a lease it granted, a path in the sentinel
directory) and a *hostile* one (``''``, ``'..'``, 4096-byte names, NUL, NaN,
2**63-1, unknown enum values, deep JSON...). A request is a valid-looking base with
none, one, some or all of its fields replaced by hostile values, so calls get past
the first check and reach the code behind it.

Absolute paths a path field receives always point into the sentinel directory
(``Context.sentinel``), so the harness can tell whether the daemon created
anything outside its root.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from ckptd.core.format import TensorEntry, str_to_dtype
from ckptd.core.shard_wire import encode
from ckptd.proto import ckptd_pb2 as pb

from .values import (
    FD,
    HOLDER_VALUES,
    HOSTILE_DOUBLES,
    HOSTILE_DTYPES,
    HOSTILE_JSON,
    HOSTILE_STRINGS,
    HUGE_WAIT,
    INT_EDGES,
    INT_RANGES,
    LONG_WAIT,
    PATH_FIELDS,
    UNKNOWN_ENUMS,
    VALID_DTYPES,
    WAIT_FIELDS,
)

SERVICE = pb.DESCRIPTOR.services_by_name["Ckptd"]


@dataclass
class Context:
    """Valid-looking values the daemon knows, grown by the harness as the run goes."""

    sentinel: Path
    jobs: list[str] = field(default_factory=list)
    steps: list[tuple[str, int]] = field(default_factory=list)
    leases: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    """Absolute paths in the sentinel directory (adoptable and watchable ones)."""
    hostile_paths: list[str] = field(default_factory=list)
    generated_names: set[str] = field(default_factory=set)
    """Last components of every generated string (to recognise stray files)."""

    def remember(self, value: str) -> str:
        """Note a generated string's last path component (bounded set)."""
        if len(self.generated_names) < 100_000:
            name = value.rstrip("/").rsplit("/", 1)[-1]
            if name and "\x00" not in name:
                self.generated_names.add(name)
        return value


def methods() -> list[MethodDescriptor]:
    """Every RPC the service descriptor declares (never a hand-kept list)."""
    return list(SERVICE.methods)


def message_class(desc: Descriptor) -> type[Message]:
    """The generated class of a message descriptor."""
    cls: type[Message] = getattr(pb, desc.name)
    return cls


def is_map(f: FieldDescriptor) -> bool:
    """Whether a field is a protobuf map."""
    return f.message_type is not None and f.message_type.GetOptions().map_entry


# -- hostile and valid scalar strategies ----------------------------------------------------
def hostile_text() -> st.SearchStrategy[str]:
    """Names and strings a careless or malicious client could send."""
    return st.one_of(
        st.sampled_from(HOSTILE_STRINGS),
        st.text(max_size=24),
        st.text(alphabet="ab.-_/\x00é", min_size=120, max_size=140),
        st.from_regex(r"[a-z][a-z0-9_.-]{0,16}", fullmatch=True),
    )


def valid_name() -> st.SearchStrategy[str]:
    """A fresh, acceptable name."""
    return st.from_regex(r"fz[a-z0-9_-]{0,12}", fullmatch=True)


def hostile_int(f: FieldDescriptor) -> st.SearchStrategy[int]:
    """Edge values of the field's width, and anything in its range."""
    lo, hi = INT_RANGES[f.type]
    edges = [v for v in INT_EDGES if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def hostile_double(f: FieldDescriptor) -> st.SearchStrategy[float]:
    """NaN, infinities, -0, negative and huge numbers; huge waits only rarely (they wait)."""
    base = st.one_of(st.sampled_from(HOSTILE_DOUBLES), st.floats(allow_nan=True))
    if f.name in WAIT_FIELDS:
        # One in about forty is a long wait (it outlasts the call's deadline when nothing
        # happens); hypothesis favours the ends of a range, so draw from a list.
        waits = HOSTILE_DOUBLES * 4 + [HUGE_WAIT]
        return st.one_of(st.sampled_from(waits), st.floats(-1e6, 0.0))
    return base


def hostile_path(ctx: Context) -> st.SearchStrategy[str]:
    """Paths: relative, traversing, too long, with NUL; absolute ones rebased into the sentinel."""
    sentinel = str(ctx.sentinel)
    rebased = hostile_text().map(lambda s: sentinel + s if s.startswith("/") else s)
    inside = hostile_text().map(lambda s: f"{sentinel}/{s}")
    return st.one_of(st.sampled_from(ctx.hostile_paths), rebased, inside)


def valid_shards() -> st.SearchStrategy[list[pb.ShardDescriptor]]:
    """One to three shards laid out back to back from offset 0, consistent with their shapes."""

    @st.composite
    def build(draw: Any) -> list[pb.ShardDescriptor]:
        out, offset = [], 0
        for i in range(draw(st.integers(1, 3))):
            dtype = draw(st.sampled_from(sorted(VALID_DTYPES)))
            shape = draw(st.lists(st.integers(1, 8), min_size=0, max_size=2))
            length = math.prod(shape) * VALID_DTYPES[dtype]
            out.append(
                pb.ShardDescriptor(
                    key=f"k{i}", dtype=dtype, shape=shape, offset=offset, length=length
                )
            )
            offset += length
        return out

    return build()


# -- field strategies -----------------------------------------------------------------------
def pick(draw: Any, values: list[Any], fallback: Any) -> Any:
    """One of ``values``, which the run grows: drawn as an index so that what hypothesis
    records does not depend on the daemon's state (it checks that replays draw alike)."""
    index = draw(st.integers(0, 2**20))
    return values[index % len(values)] if values else fallback


def valid_value(f: FieldDescriptor, ctx: Context, draw: Any) -> Any:
    """A value that passes the daemon's checks (as far as a generic field can)."""
    name = f.name
    if f.type == FD.TYPE_STRING:
        if name == "job":
            return draw(st.sampled_from(ctx.jobs))
        if name == "lease_id":
            return pick(draw, ctx.leases, "no-lease-yet")
        if name in PATH_FIELDS:
            return draw(st.sampled_from(ctx.paths))
        if name.endswith("_json"):
            return draw(st.sampled_from(["", "{}", '{"lr": 0.1, "tags": ["a"]}']))
        if name == "dtype":
            return draw(st.sampled_from(sorted(VALID_DTYPES)))
        if name == "key":
            return draw(st.from_regex(r"[a-z]{1,8}", fullmatch=True))
        return draw(valid_name())
    if f.type in INT_RANGES:
        if name == "step":
            known = pick(draw, ctx.steps, ("", 1))[1]
            return known if draw(st.booleans()) else draw(st.integers(0, 1000))
        if name == "size_bytes":
            return draw(st.sampled_from([1, 16, 4096, 65536, 2**20]))
        if name == "rank":
            return 0
        if name == "world_size":
            return draw(st.sampled_from([0, 1, 4]))
        if name == "data_offset":
            return draw(st.sampled_from([0, 4096]))
        return draw(st.integers(0, 3))
    if f.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        if name in WAIT_FIELDS:
            return draw(st.floats(0.0, 0.05))
        return draw(st.floats(-1e6, 1e6))
    if f.type == FD.TYPE_ENUM:
        return draw(st.sampled_from([v.number for v in f.enum_type.values]))
    if f.type == FD.TYPE_BOOL:
        return draw(st.booleans())
    if f.type == FD.TYPE_BYTES:
        return draw(st.binary(max_size=16))
    raise AssertionError(f"no strategy for field {f.full_name} of type {f.type}")


def hostile_value(f: FieldDescriptor, ctx: Context, draw: Any) -> Any:
    """A value a careless or malicious client could put in this field."""
    name = f.name
    if f.type == FD.TYPE_STRING:
        if name in PATH_FIELDS:
            return ctx.remember(draw(hostile_path(ctx)))
        if name.endswith("_json"):
            return draw(st.one_of(st.sampled_from(HOSTILE_JSON), hostile_text()))
        if name == "dtype":
            return draw(st.one_of(st.sampled_from(HOSTILE_DTYPES), hostile_text()))
        return ctx.remember(draw(hostile_text()))
    if f.type in INT_RANGES:
        return draw(hostile_int(f))
    if f.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return draw(hostile_double(f))
    if f.type == FD.TYPE_ENUM:
        known = [v.number for v in f.enum_type.values]
        return draw(st.sampled_from(known + UNKNOWN_ENUMS))
    if f.type == FD.TYPE_BOOL:
        return draw(st.booleans())
    if f.type == FD.TYPE_BYTES:
        return draw(st.sampled_from([b"", b"\x00" * 4096, b"\xff\xfe"]) | st.binary(max_size=64))
    raise AssertionError(f"no strategy for field {f.full_name} of type {f.type}")


def fill_field(msg: Message, f: FieldDescriptor, ctx: Context, draw: Any, hostile: bool) -> None:
    """Set field ``f`` of ``msg``: scalar, repeated, map or nested message."""
    value_of = hostile_value if hostile else valid_value
    target = getattr(msg, f.name)
    if is_map(f):
        key_f = f.message_type.fields_by_name["key"]
        val_f = f.message_type.fields_by_name["value"]
        size = draw(st.sampled_from([0, 1, 2, 3, 257])) if hostile else draw(st.integers(0, 3))
        for _ in range(size):
            key = value_of(key_f, ctx, draw) if size < 10 else draw(valid_name())
            if val_f.message_type is not None:
                target[key].CopyFrom(draw(message(val_f.message_type, ctx, hostile)))
            else:
                target[key] = value_of(val_f, ctx, draw)
        return
    if f.is_repeated:
        if f.name == "shards" and not hostile:
            target.extend(draw(valid_shards()))
            return
        if f.message_type is not None:
            count = draw(st.integers(0, 4))
            for _ in range(count):
                target.add().CopyFrom(draw(message(f.message_type, ctx, hostile)))
            return
        if not hostile:
            return  # ranks, shapes and indexes: empty is the valid default
        count = draw(st.sampled_from([0, 1, 2, 3, 5, 70, 65537]))
        if count > 100:  # one value repeated: long lists without a long draw
            value = (
                draw(valid_or_edge_int(f)) if f.type in INT_RANGES else valid_value(f, ctx, draw)
            )
            target.extend([value] * count)
        else:
            target.extend(hostile_value(f, ctx, draw) for _ in range(count))
        return
    if f.name == "table" and not hostile:
        # A valid commit sends its shards one way or the other: as columns half the time.
        shards = list(getattr(msg, "shards", []))
        valid = all(sd.dtype in VALID_DTYPES and len(sd.shape) <= 2 for sd in shards)
        if shards and valid and draw(st.booleans()):
            del msg.shards[:]  # type: ignore[attr-defined]
            target.CopyFrom(as_table(shards))
        return
    if f.message_type is not None:
        target.CopyFrom(draw(message(f.message_type, ctx, hostile)))
        return
    setattr(msg, f.name, value_of(f, ctx, draw))


def as_table(shards: list[pb.ShardDescriptor]) -> pb.ShardTable:
    """Valid shard descriptors as the columns a client sends."""
    entries = [
        TensorEntry(s.key, str_to_dtype(s.dtype), tuple(s.shape), s.offset, s.length)
        for s in shards
    ]
    return encode(entries, {s.key: s.dtype for s in shards}, {})


def valid_or_edge_int(f: FieldDescriptor) -> st.SearchStrategy[int]:
    """An integer for a long repeated field (one value, repeated)."""
    lo, hi = INT_RANGES.get(f.type, (0, 1))
    return st.integers(max(lo, 0), min(hi, 3))


@st.composite
def message(draw: Any, desc: Descriptor, ctx: Context, hostile: bool) -> Message:
    """A nested message: all valid, or each field hostile with probability one half."""
    msg = message_class(desc)()
    for f in desc.fields:
        if f.has_presence and f.containing_oneof is not None and draw(st.booleans()):
            continue  # proto3 optional, left unset
        fill_field(msg, f, ctx, draw, hostile and draw(st.booleans()))
    return msg


@dataclass
class Case:
    """One generated call: the RPC, its request, which fields are hostile, extra metadata."""

    method: str
    request: Message
    hostile: frozenset[str]
    metadata: tuple[tuple[str, str], ...] = ()

    def waits_long(self) -> bool:
        """Whether a wait field asks the daemon to wait longer than a case's deadline."""
        for name in WAIT_FIELDS:
            value = getattr(self.request, name, None)
            if isinstance(value, float) and not math.isnan(value) and value > LONG_WAIT:
                return True
        return False


@st.composite
def case(draw: Any, ctx: Context, method: MethodDescriptor) -> Case:
    """A request for ``method``: valid-looking, with none, one, some or all fields hostile."""
    desc = method.input_type
    msg = message_class(desc)()
    fields = list(desc.fields)
    mode = draw(st.sampled_from(["valid", "one", "one", "some", "all"]))
    if mode == "valid" or not fields:
        bad: set[str] = set()
    elif mode == "one":
        bad = {draw(st.sampled_from(fields)).name}
    elif mode == "some":
        bad = {f.name for f in fields if draw(st.booleans())}
    else:
        bad = {f.name for f in fields}
    for f in fields:
        if f.has_presence and f.containing_oneof is not None and draw(st.integers(0, 3)) == 0:
            continue  # proto3 optional (Restore.step, EnsureLocal.step): absent
        fill_field(msg, f, ctx, draw, f.name in bad)
    metadata: tuple[tuple[str, str], ...] = ()
    if draw(st.integers(0, 9)) == 0:
        metadata = (("ckptd-holder", draw(st.sampled_from(HOLDER_VALUES))),)
    return Case(method.name, msg, frozenset(bad), metadata)
