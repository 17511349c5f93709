"""The journal's on-disk records: framing, reading back after damage, and the schema.

A record is ``<marker><u32 length><u32 crc32c(payload)><payload>``; the payload
is a JSON header line, ``\\n``, then the body (the serialised request). The
4-byte marker lets the reader find the next record after a damaged one (a
flipped byte, a torn write in the middle of the file) instead of dropping every
record behind it. As a little-endian u32 the marker is above the largest length
a record may have, so a record written before markers existed
(``<u32 length><u32 crc32c><payload>``) never starts with it: both are read.

Reading checks each record twice: its frame (length, crc) and then its header
against the schema (types, names safe as path components, step numbers in
range). A record that fails either is refused and reported by what can still be
read of it (its job, step and lease), never allowed to stop the daemon's start.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

from ckptd.core import checksum
from ckptd.core.errors import InvalidArgument
from ckptd.core.names import check_name, check_step

MARKER = b"\x9fCKJ"
"""Starts every record; as a little-endian u32 it exceeds MAX_RECORD (see the module doc)."""
MAX_RECORD = 256 * 2**20
_NEW = struct.Struct("<4sII")
_OLD = struct.Struct("<II")
_OLD_START = b'{"op":"'  # every payload starts so: what finds an old record after damage
_LEASE_BYTES = 64
MIN_RECORD = _NEW.size + len(b'{"op":"done","lease":"x"}\n')
"""The smallest record there is (a done record)."""
_NAMING = re.compile(
    rb'"op":"(?P<op>commit|done)","lease":"(?P<lease>[^"\n]{0,64})"'
    rb'(?:,"segment":"[^"\n]{0,255}","job":"(?P<job>[^"\n]{1,255})"(?:,"step":(?P<step>\d{1,19}))?)?'
)
assert int.from_bytes(MARKER, "little") > MAX_RECORD


def frame(header: dict[str, Any], body: bytes = b"") -> bytes:
    """One record: ``header`` as compact JSON (keys in the order given), then ``body``."""
    payload = json.dumps(header, separators=(",", ":")).encode() + b"\n" + body
    return _NEW.pack(MARKER, len(payload), checksum.value(payload)) + payload


@dataclass(frozen=True)
class Lost:
    """A stretch of the journal that held no readable record, or a record refused.

    ``op``, ``lease``, ``job`` and ``step`` are what could still be read of it
    (empty or None when nothing could)."""

    offset: int
    nbytes: int
    why: str
    op: str = ""
    lease: str = ""
    job: str = ""
    step: int | None = None

    def describe(self) -> str:
        """One line for the log: which save this was, or how much was skipped."""
        where = f"at byte {self.offset} ({self.nbytes} bytes) "
        if self.op == "commit" and self.job:
            step = f"step {self.step}" if self.step is not None else "an unknown step"
            return (
                f"the acknowledged save of job {self.job!r} {step} (lease {self.lease!r}) is lost "
                f"unless it is on disk already: its journal record {where}{self.why}; save "
                "that step again"
            )
        if self.op == "done":
            return (
                f"the done record of lease {self.lease!r} {where}{self.why}; its save is "
                "replayed if its record is live and retired if its step is on disk"
            )
        if self.harmless:
            return f"{self.nbytes} bytes of the journal {where}are no record (skipped)"
        return (
            f"{self.nbytes} bytes of the journal {where}{self.why}; no save in them "
            "could be named: check the trainers' last saves"
        )

    @property
    def harmless(self) -> bool:
        """Too few bytes to have held a record (a damaged marker before an intact
        record that was read): nothing is lost."""
        return not self.op and self.nbytes < MIN_RECORD


@dataclass(frozen=True)
class Scan:
    """What :func:`scan` read: the records whose frames are intact, what was lost,
    and the bytes at the end that a crash cut short (never acknowledged)."""

    records: list[tuple[int, int, Any, bytes]]
    """``(offset, size, header, body)`` of each intact record, in file order (the
    header as JSON decoded it: not yet checked, see :func:`check`)."""
    lost: list[Lost]
    torn_tail: int


def _frame_at(data: bytes, at: int) -> tuple[int, bytes] | None:
    """The length and payload of an intact record at ``at`` (either format), or None."""
    if data.startswith(MARKER, at):
        if at + _NEW.size > len(data):
            return None
        _, length, crc = _NEW.unpack_from(data, at)
        start = at + _NEW.size
    elif at + _OLD.size <= len(data):
        length, crc = _OLD.unpack_from(data, at)
        start = at + _OLD.size
        if not data.startswith(_OLD_START, start):
            return None
    else:
        return None
    payload = data[start : start + length]
    if length > MAX_RECORD or len(payload) != length or checksum.value(payload) != crc:
        return None
    return start - at + length, payload


def _next_start(data: bytes, after: int) -> int:
    """The first offset past ``after`` where a record may start (len(data): none)."""
    marker = data.find(MARKER, after + 1)
    old = data.find(_OLD_START, after + 1 + _OLD.size)
    candidates = [c for c in (marker, old - _OLD.size if old >= 0 else -1) if c > after]
    return min(candidates) if candidates else len(data)


def _extent(data: bytes, at: int) -> int:
    """Where the record at ``at`` would end by its own length (may exceed len(data))."""
    fmt = _NEW if data.startswith(MARKER, at) else _OLD
    if at + fmt.size > len(data):
        return len(data) + 1
    length = fmt.unpack_from(data, at)[-2]
    return at + fmt.size + length if length <= MAX_RECORD else len(data) + 1


def _named(data: bytes, at: int, end: int, why: str) -> list[Lost]:
    """The damaged stretch ``data[at:end]``, as one Lost per record header still legible
    in it (a header's text survives a flipped byte in the body), or one for the stretch."""
    found = list(_NAMING.finditer(data, at, end))
    if not found:
        return [Lost(at, end - at, why)]
    out = []
    for n, m in enumerate(found):
        stop = found[n + 1].start() if n + 1 < len(found) else end
        start = at if n == 0 else m.start()
        step = m.group("step")
        out.append(
            Lost(
                start,
                stop - start,
                why,
                m.group("op").decode(),
                m.group("lease").decode(errors="replace"),
                (m.group("job") or b"").decode(errors="replace"),
                int(step) if step is not None else None,
            )
        )
    return out


def scan(data: bytes) -> Scan:
    """Every intact record of ``data``; a damaged one is skipped up to the next record
    start that checks out, and named where its header can still be read."""
    records: list[tuple[int, int, Any, bytes]] = []
    lost: list[Lost] = []
    at = 0
    while at < len(data):
        got = _frame_at(data, at)
        if got is not None:
            size, payload = got
            head, _, body = payload.partition(b"\n")
            try:
                header = json.loads(head)
            except (ValueError, RecursionError):  # RecursionError: crafted deep nesting
                lost.append(_refused(at, size, {}, "is not a JSON header"))
            else:
                records.append((at, size, header, body))
            at += size
            continue
        nxt = _next_start(data, at)
        while nxt < len(data) and _frame_at(data, nxt) is None:
            nxt = _next_start(data, nxt)
        if nxt == len(data) and (_extent(data, at) > len(data) or not data[at:].strip(b"\0")):
            # Nothing intact after it, and it runs past the end (or is the zeros a file
            # system leaves of an append never synced): a crash mid-append, whose record
            # was never fsynced and so never acknowledged.
            return Scan(records, lost, len(data) - at)
        lost.extend(_named(data, at, nxt, "fails its checksum"))
        at = nxt
    return Scan(records, lost, 0)


def _refused(at: int, size: int, header: Any, why: str) -> Lost:
    """A refused record, named by whichever of its header fields are readable."""
    h = header if isinstance(header, dict) else {}

    def text(key: str) -> str:
        v = h.get(key)
        return v[: _LEASE_BYTES * 4] if isinstance(v, str) else ""

    step = h.get("step")
    step = step if isinstance(step, int) and not isinstance(step, bool) else None
    return Lost(at, size, why, text("op"), text("lease"), text("job"), step)


def check(at: int, size: int, header: Any, body: bytes) -> Lost | None:
    """None if the record at ``at`` holds what :func:`frame` writes; else why it is refused."""
    if not isinstance(header, dict):
        kind = type(header).__name__
        return _refused(at, size, header, f"is not a record (its header is a JSON {kind})")
    op = header.get("op")
    if op not in ("commit", "done"):
        return _refused(at, size, header, f"has an unknown op {str(op)[:40]!r}")
    try:
        lease = header.get("lease")
        if not isinstance(lease, str) or len(lease) > _LEASE_BYTES:
            raise InvalidArgument(f"lease {str(lease)[:40]!r} is not a lease id")
        check_name("lease", lease)
        if op == "commit":
            for key in ("segment", "job"):
                if not isinstance(header.get(key), str):
                    raise InvalidArgument(f"{key} is missing or not a string")
            check_name("segment", header["segment"])
            check_name("job", header["job"])
            step = header.get("step")  # absent in records written before steps were
            if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
                raise InvalidArgument(f"step {str(step)[:40]!r} is not an integer")
            if step is not None:
                check_step(step)
            nbytes = header.get("size")  # the segment's size; absent in older records
            if nbytes is not None and (
                not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0
            ):
                raise InvalidArgument(f"size {str(nbytes)[:40]!r} is not a segment size")
            if not body:
                raise InvalidArgument("it holds no request")
    except InvalidArgument as exc:
        return _refused(at, size, header, f"is malformed ({exc})")
    return None
