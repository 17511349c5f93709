"""Validation of every name that can reach a filesystem path or a file header, and of
the numbers that bound how long the daemon waits for a caller."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from .errors import InvalidArgument

MAX_NAME_BYTES = 255
"""Longest file name the kernel takes: the limit of a name no file name is derived from."""
MAX_JOB_BYTES = 128
"""Longest job name. The daemon derives file names from it (and from node names) that
must stay within MAX_NAME_BYTES: the longest is a peer's download directory,
``<job>.<step>.<node>.<8 hex>`` (128 + 1 + 19 + 1 + 96 + 1 + 8 = 254 bytes), then a
replaced step's ``<job>.<step>.<8 hex>.replaced-<8 hex>`` (175 bytes)."""
MAX_NODE_BYTES = 96
"""Longest node name (``node_id``; host names are cut to 63 bytes by default)."""
MAX_SHARD_KEY_BYTES = 1024
MAX_STEP = 2**62
MAX_PATH_BYTES = 4095
"""Longest path the kernel takes (PATH_MAX less the terminating NUL), also the longest
relative path inside an adopted tree."""
MAX_PATH_DEPTH = 64
"""Deepest relative path inside an adopted tree (Orbax trees are a few levels deep)."""
_LIMITS = {"job": MAX_JOB_BYTES, "node": MAX_NODE_BYTES, "node_id": MAX_NODE_BYTES}


def check_name(kind: str, value: str, max_bytes: int | None = None) -> str:
    """Accept a job, node or segment name that is safe as one path component.

    Rejects empty names, separators, ``..``, NUL and other control characters,
    a leading dot (reserved for ``.staging`` and ``.cache``) and over-long names:
    ``max_bytes``, by default MAX_JOB_BYTES for a job, MAX_NODE_BYTES for a node
    and MAX_NAME_BYTES for anything else.
    """
    max_bytes = max_bytes if max_bytes is not None else _LIMITS.get(kind, MAX_NAME_BYTES)
    if not value:
        raise InvalidArgument(f"{kind} name is empty; give a non-empty {kind} name")
    bad = _why_bad(value, max_bytes)
    if bad is None and value.startswith("."):
        bad = "starts with '.' (names starting with a dot are reserved for ckptd)"
    if bad:
        raise InvalidArgument(
            f"{kind} name {value[:80]!r} {bad}; use at most {max_bytes} bytes with no '/', "
            "'\\', '..', control character or leading '.' (letters, digits, '-', '_' and "
            "'.' are always safe)"
        )
    return value


def check_shard_key(value: str) -> str:
    """Accept a shard key (a tensor name inside a safetensors file)."""
    if not value:
        raise InvalidArgument("shard key is empty; every shard needs a key")
    bad = _why_bad(value, MAX_SHARD_KEY_BYTES)
    if bad is None and value == "__metadata__":
        bad = "is reserved by the safetensors format"
    if bad:
        raise InvalidArgument(f"shard key {value[:80]!r} {bad}; rename the shard")
    return value


def check_tree_path(kind: str, value: str) -> str:
    """Accept a relative POSIX path inside an adopted tree (``files/default/.zarray``).

    Every component must be a plain name: no empty component (``a//b``, a trailing
    ``/``), no ``.`` or ``..``, no NUL or control character, at most 255 bytes;
    the path is not absolute and is bounded in length and depth. Unlike
    :func:`check_name`, a component may start with a dot (zarr's ``.zarray``) and
    hold ``..`` inside it: frameworks write such files, and neither can leave the tree.
    """
    if not value:
        raise InvalidArgument(f"{kind} is empty")
    bad = None
    parts = value.split("/")
    if value.startswith("/"):
        bad = "is an absolute path"
    elif len(value.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        bad = f"is longer than {MAX_PATH_BYTES} bytes"
    elif len(parts) > MAX_PATH_DEPTH:
        bad = f"is deeper than {MAX_PATH_DEPTH} directories"
    elif any(p in ("", ".", "..") for p in parts):
        bad = "has an empty, '.' or '..' component"
    elif any(len(p.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES for p in parts):
        bad = f"has a component longer than {MAX_NAME_BYTES} bytes"
    elif _CONTROL.search(value):
        bad = "contains a NUL or control character"
    if bad:
        raise InvalidArgument(f"{kind} {value[:80]!r} {bad}; it must stay inside its tree")
    return value


def check_step(step: int) -> int:
    """Accept a step number: a non-negative integer below 2**62."""
    if step < 0 or step >= MAX_STEP:
        raise InvalidArgument(f"step {step} is out of range; steps are integers in [0, 2**62)")
    return step


Owner = tuple[int | None, bool]
"""A job's owner as a record from elsewhere says it (a node's bucket index, a peer's
replica): ``(uid, known)``. ``uid`` None and ``known``: nobody's (an operator's job,
open); ``known`` False: the record does not say (written before owners were
recorded), so the job stays closed until an operator assigns it."""
UNKNOWN_OWNER: Owner = (None, False)


def recorded_owner(record: Mapping[str, object]) -> Owner:
    """The owner ``record``'s ``owner`` key says (absent: not known). ValueError for a
    value that is not a uid (or -1, a job saved before owners were recorded)."""
    if "owner" not in record:
        return UNKNOWN_OWNER
    owner = record["owner"]
    if owner is None:
        return None, True
    if type(owner) is int and -1 <= owner < 2**32:
        return owner, True
    raise ValueError(f"an owner that is not a uid: {str(owner)[:40]!r}")


def owner_or_unknown(record: Mapping[str, object]) -> Owner:
    """:func:`recorded_owner`, a value that is not a uid counting as not known (a
    peer's word: the job then stays closed, as with no word at all)."""
    try:
        return recorded_owner(record)
    except ValueError:
        return UNKNOWN_OWNER


def check_path(field: str, value: str, *, optional: bool = False) -> str:
    """Accept an absolute path a client names (a directory to adopt, watch or fill).

    ``optional``: an empty value is accepted (the daemon's default applies).
    Refuses relative paths, NUL bytes, and paths the kernel would refuse as too
    long, so none of those reaches a system call.
    """
    if not value:
        if optional:
            return value
        raise InvalidArgument(f"no {field} given; name an absolute path")
    if "\x00" in value:
        raise InvalidArgument(
            f"{field} {value[:80]!r} contains a NUL byte, which no path can hold; remove it"
        )
    if not value.startswith("/"):
        raise InvalidArgument(
            f"{field} {value[:80]!r} is not an absolute path; give the daemon one"
        )
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_PATH_BYTES:
        raise InvalidArgument(
            f"{field} is {size} bytes long; paths have at most {MAX_PATH_BYTES} bytes"
        )
    for part in value.split("/"):
        if len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise InvalidArgument(
                f"{field} has a component of more than {MAX_NAME_BYTES} bytes "
                f"({part[:40]!r}...); shorten that file or directory name"
            )
    return value


def check_wait(field: str, seconds: float, cap: float) -> float:
    """Accept a wait in seconds: NaN and negative values are refused; longer waits
    than ``cap`` (infinity included) wait ``cap`` seconds, as the API documents."""
    if math.isnan(seconds) or seconds < 0:
        raise InvalidArgument(
            f"{field} is {seconds}; give a number of seconds from 0 (do not wait) to "
            f"{cap:.0f} (longer waits are cut to {cap:.0f})"
        )
    return min(seconds, cap)


def _why_bad(value: str, max_bytes: int) -> str | None:
    if len(value.encode("utf-8", "surrogatepass")) > max_bytes:
        return f"is longer than {max_bytes} bytes in UTF-8 (ckptd derives file names from it)"
    if "/" in value or "\\" in value:
        return "contains a path separator"
    if ".." in value:
        return "contains '..'"
    if _CONTROL.search(value):  # a regex: a per-character loop cost 8 us per shard key
        return "contains a NUL or control character"
    return None


_CONTROL = re.compile("[\x00-\x1f\x7f]")
