"""Object keys in the remote tier, for both kinds of step.

A step saved through ckptd (``Client.save``)::

    <job>/<step>/<node>/manifest.json
    <job>/_data/<hh>/<node>/<step>.<timeline>/rank-*.safetensors
                                           the rank files (manifest data_layout 3;
                                           layout 2: under <step>/, no timeline)
    <job>/<step>/<node>/ranks-<lo>-<hi>    empty: the ranks the node's part holds
    <job>/<step>/_complete/<node>          the commit point of that node's part
    <job>/<step>/_pinned                   a pin
    <job>/_index/<node>.json               the node's complete steps (index.py)
    <job>/_retention/<node>.json           the job's own retention, as set on that node
    _nodes/<node>/instance                 the daemon holding the node name (claim.py)

The rank files are most of a step's requests (every part of every multipart
upload). Under ``<job>/<step>/`` they would all land in one key range that is new
at every step, so S3 (which splits a prefix's ~3,500 writes/s only after sustained
load) and GCS (which ramps a key range up over minutes) would never catch up.
Under ``<job>/_data/<hh>/<node>/``, ``<hh>`` two hex digits of the node name's
crc32c, each node writes the same key range at every step, and the 256 ranges
spread the nodes evenly: the store partitions them once and they stay partitioned
(docs/scale.md). Steps drained before this layout (manifest ``data_layout`` 1,
or none) keep their rank files beside the manifest, at
``<job>/<step>/<node>/rank-*``, and are read from there: the manifest of each
node's copy says which.

A step adopted from a directory (an Orbax step, ``ckptd adopt``) keeps its tree
byte-identical where the framework itself would look for it, and ckptd's own
records beside it, never inside it (Orbax treats any sub-directory of a step as
an item and would fail to restore it without arguments)::

    <job>/<step>/<the adopted tree>        e.g. _CHECKPOINT_METADATA, default/...
    <job>/<step>.ckptd/<node>/manifest.json
    <job>/<step>.ckptd/_complete/<node>
    <job>/<step>.ckptd/_pinned

Frameworks list ``<job>/`` for numeric names, so ``<step>.ckptd`` is invisible to
them; ``ocp.CheckpointManager("gs://bucket/<job>")`` reads the adopted steps as
if Orbax had written them there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from ckptd.core import checksum
from ckptd.core.errors import InvalidArgument
from ckptd.core.manifest import (
    DATA_BY_STEP,
    DATA_SPREAD,
    DATA_TIMELINE,
    MAX_WORLD_SIZE,
    TREE_PREFIX,
)
from ckptd.core.names import check_name, check_step, check_tree_path

# Re-exported: the bucket's keys use them; adoption (above the tiers) takes them from commit.py.
from ..commit import COMMIT_FILE as COMMIT_FILE
from ..commit import FILES_DIR as FILES_DIR
from .records import valid_names

ADOPTED_SUFFIX = ".ckptd"
RANKS_PREFIX = "ranks-"
DATA_DIR = "_data"
"""``<job>/_data/``: the rank files of the spread layout (not a step: never listed as one)."""


class MarkerKey(NamedTuple):
    """A parsed ``_complete`` marker key."""

    job: str
    step: int
    node: str
    adopted: bool


def record_prefix(job: str, step: int, adopted: bool = False) -> str:
    """Where ckptd's records of a step (markers, manifests, pin) live."""
    return f"{job}/{step}{ADOPTED_SUFFIX if adopted else ''}"


def step_prefix(job: str, step: int) -> str:
    """``<job>/<step>`` in the bucket (an adopted step's tree sits right here)."""
    return f"{job}/{step}"


def marker_key(job: str, step: int, node: str, adopted: bool = False) -> str:
    """The commit point of one node's part of a step in the bucket."""
    return f"{record_prefix(job, step, adopted)}/_complete/{node}"


def manifest_key(job: str, step: int, node: str, adopted: bool = False) -> str:
    """One node's manifest of a step."""
    return f"{record_prefix(job, step, adopted)}/{node}/manifest.json"


def file_key(
    job: str,
    step: int,
    node: str,
    file: str,
    adopted: bool = False,
    layout: int = DATA_BY_STEP,
    timeline: int = 0,
) -> str:
    """Where a file of a node's part goes: under the node's data prefix of the step
    (``layout``: the manifest's ``data_layout``; ``timeline``: its timeline), or
    (adopted) at its tree path. ``file`` must be a plain name (a relative path under
    ``files/`` if adopted): a manifest's names never make a key outside the step
    (InvalidArgument)."""
    if adopted:
        return f"{step_prefix(job, step)}/{tree_path(file)}"
    return f"{data_prefix(job, step, node, layout, timeline)}/{check_name('file', file)}"


def data_prefix(
    job: str, step: int, node: str, layout: int = DATA_BY_STEP, timeline: int = 0
) -> str:
    """The prefix of a node's rank files of a (not adopted) step, by ``layout`` (and,
    from layout 3 on, the step's ``timeline``: saves of two timelines under one number
    never share a key)."""
    if layout == DATA_TIMELINE:
        return f"{job}/{DATA_DIR}/{spread(node)}/{node}/{step}.{timeline}"
    if layout == DATA_SPREAD:
        return f"{job}/{DATA_DIR}/{spread(node)}/{node}/{step}"
    if layout == DATA_BY_STEP:
        return f"{step_prefix(job, step)}/{node}"
    raise InvalidArgument(f"unknown data_layout {layout!r}; upgrade ckptd")


def spread(node: str) -> str:
    """The node's key range among 256: two hex digits of its name's crc32c (stable
    across versions and machines, unlike Python's ``hash``)."""
    return f"{checksum.value(node.encode()) & 0xFF:02x}"


def ranks_key(job: str, step: int, node: str, ranks: Iterable[int]) -> str:
    """An empty object naming the lowest and highest rank of a node's part of a step:
    a node that needs a rank another node saved (a replacement under a new name)
    finds the part holding it in one listing of the step's records instead of reading
    the manifests of the step's nodes in turn. Beside the node's manifest, so the
    part's eviction removes it with the rest."""
    got = list(ranks)
    return f"{record_prefix(job, step)}/{node}/{RANKS_PREFIX}{min(got)}-{max(got)}"


def parse_ranks_key(key: str) -> tuple[str, int, int] | None:
    """``(node, lowest, highest)`` if ``key`` is a :func:`ranks_key`: valid names only,
    ranks that a world can hold, the lowest first."""
    parts = key.split("/")
    if len(parts) != 4 or not parts[3].startswith(RANKS_PREFIX):
        return None
    lo, sep, hi = parts[3].removeprefix(RANKS_PREFIX).partition("-")
    most = len(str(MAX_WORLD_SIZE))  # no int() of a key's thousand digits
    if not (sep and all(v.isascii() and v.isdigit() and len(v) <= most for v in (lo, hi))):
        return None
    if not (int(lo) <= int(hi) < MAX_WORLD_SIZE and valid_names(key, node=parts[2])):
        return None
    return parts[2], int(lo), int(hi)


def tree_path(file: str) -> str:
    """An adopted file's path inside the adopted tree (the manifest records ``files/<path>``);
    InvalidArgument if ``file`` is not such a record or its path could leave the tree."""
    if not file.startswith(TREE_PREFIX):
        raise InvalidArgument(f"adopted file {file[:80]!r} is not under {TREE_PREFIX}")
    return check_tree_path("adopted file", file).removeprefix(TREE_PREFIX)


def upload_order(files: list[str]) -> list[list[str]]:
    """Adopted files in upload waves: everything else, then the item-level
    ``commit_success.txt`` files, then the step-level one alone (Orbax's commit point)."""
    top = f"{FILES_DIR}/{COMMIT_FILE}"
    rest = [f for f in files if f.rsplit("/", 1)[-1] != COMMIT_FILE]
    items = [f for f in files if f.rsplit("/", 1)[-1] == COMMIT_FILE and f != top]
    return [w for w in (rest, items, [top] if top in files else []) if w]


def parse_marker(key: str) -> MarkerKey | None:
    """The marker's job, step, node and kind if ``key`` is a ``_complete`` marker whose
    job, step and node are valid names (others are skipped, with one warning each)."""
    parts = key.split("/")
    if len(parts) != 4 or parts[2] != "_complete":
        return None
    step, adopted = _parse_step(parts[1])
    if step is None or not valid_names(key, job=parts[0], node=parts[3]):
        return None
    return MarkerKey(parts[0], step, parts[3], adopted)


@dataclass
class RemoteStep:
    """A step with at least one ``_complete`` marker in the bucket."""

    nodes: set[str] = field(default_factory=set)
    """The nodes whose marker is there."""
    adopted: bool = False
    """An adopted directory tree."""
    timeline: int | None = None
    """Its timeline, where a marker of it was read (None: only listed)."""
    forks: tuple[tuple[int, int], ...] = ()
    """The job's lineage as that marker records it (core/timeline.py)."""
    created_unix: float = 0.0
    """When the step was committed, where a marker of it was read (0: not known)."""


def complete_steps_in(keys: Iterable[str]) -> dict[tuple[str, int], RemoteStep]:
    """``(job, step)`` -> its markers, for every marker among ``keys`` (a listing)."""
    steps: dict[tuple[str, int], RemoteStep] = {}
    for key in keys:
        parsed = parse_marker(key)
        if parsed is not None:
            found = steps.setdefault((parsed.job, parsed.step), RemoteStep())
            found.nodes.add(parsed.node)
            found.adopted = found.adopted or parsed.adopted
    return steps


def retention_key(job: str, node: str) -> str:
    """The job's own retention policy, as its trainer set it on ``node`` (outlives the
    node; read back only by that node's name)."""
    return f"{job}/_retention/{node}.json"


def pin_key(job: str, step: int, adopted: bool = False) -> str:
    """A pinned step's pin in the bucket (so it outlives the node that pinned it)."""
    return f"{record_prefix(job, step, adopted)}/_pinned"


def parse_step_name(name: str) -> tuple[int | None, bool]:
    """A listed step directory's number (None: not a step ckptd writes) and whether it
    holds an adopted step's records (``<step>.ckptd``)."""
    return _parse_step(name.rstrip("/").rsplit("/", 1)[-1])


def _parse_step(name: str) -> tuple[int | None, bool]:
    """A step directory's number as ckptd writes it (``str(step)``, ASCII digits, no
    leading zero, in range) and whether it is an adopted step's records."""
    adopted = name.endswith(ADOPTED_SUFFIX)
    digits = name.removesuffix(ADOPTED_SUFFIX) if adopted else name
    # isdigit() alone admits '²' (int() then raises) and other scripts' digits.
    if not (digits.isascii() and digits.isdigit() and str(int(digits)) == digits):
        return None, adopted
    try:
        return check_step(int(digits)), adopted
    except InvalidArgument:
        return None, adopted
