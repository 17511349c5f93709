"""Validation of every name that can reach a filesystem path or a file header."""

from __future__ import annotations

from .errors import InvalidArgument

MAX_NAME_BYTES = 255
MAX_SHARD_KEY_BYTES = 1024
MAX_STEP = 2**62
MAX_PATH_BYTES = 4095
"""Longest relative path inside an adopted tree (PATH_MAX less the terminating NUL)."""
MAX_PATH_DEPTH = 64
"""Deepest relative path inside an adopted tree (Orbax trees are a few levels deep)."""


def check_name(kind: str, value: str, max_bytes: int = MAX_NAME_BYTES) -> str:
    """Accept a job, node or segment name that is safe as one path component.

    Rejects empty names, separators, ``..``, NUL and other control characters,
    a leading dot (reserved for ``.staging`` and ``.cache``) and over-long names.
    """
    if not value:
        raise InvalidArgument(f"{kind} name is empty; give a non-empty {kind} name")
    bad = _why_bad(value, max_bytes)
    if bad is None and value.startswith("."):
        bad = "starts with '.' (names starting with a dot are reserved for ckptd)"
    if bad:
        raise InvalidArgument(
            f"{kind} name {value[:80]!r} {bad}; use letters, digits, '-', '_' and '.' only"
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
    elif any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        bad = "contains a NUL or control character"
    if bad:
        raise InvalidArgument(f"{kind} {value[:80]!r} {bad}; it must stay inside its tree")
    return value


def check_step(step: int) -> int:
    """Accept a step number: a non-negative integer below 2**62."""
    if step < 0 or step >= MAX_STEP:
        raise InvalidArgument(f"step {step} is out of range; steps are integers in [0, 2**62)")
    return step


def _why_bad(value: str, max_bytes: int) -> str | None:
    if len(value.encode("utf-8", "surrogatepass")) > max_bytes:
        return f"is longer than {max_bytes} bytes"
    if "/" in value or "\\" in value:
        return "contains a path separator"
    if ".." in value:
        return "contains '..'"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return "contains a NUL or control character"
    return None
