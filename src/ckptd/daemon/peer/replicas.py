"""The replicas this daemon holds for its peers, on its own disk.

    <root>/.replicas/<job>/<source node>/<step>/manifest.json + owner.json + rank files
    <root>/.replicas/.incoming/<random>/             a replica being received

Per (job, source node): the replica its source sent last (its *head*), and the
older steps it references (an incremental step's rank files hold only what
changed: core/increments.py), transitively. Each sender is authenticated as the
node it claims to be (identity.py) before this store sees its replica, so the
last one sent is the source's newest save, whatever its number: a replica never
blocks a later one (a step number is only what the manifest says). A step a newer
one references is sent first, named as a *holder* for it (``holder_for``): it is
kept beside the head without replacing it, and an incremental replica is refused
unless every step it references is held here already. A replica is received into
``.incoming`` file by file, each checked against the crc32c its manifest records
as it lands, then ``manifest.json`` is written and the directory renamed into
place (the commit point); once a head is in, the replicas of its (job, source)
it does not need (itself and its references, transitively) are removed. A crash
leaves whole replicas only, never a part; ``.incoming`` is emptied at start-up,
where the last head written is found again (a holder's directory is marked) and
what it does not need removed. Everything a peer sends is checked like a bucket's
manifest (names, sizes, files within the step) before a byte is written, and the
replicas together stay within ``peer_budget_bytes``. Each replica keeps the owner
its source said the job has (``owner.json``): a node that lost its disk takes its
jobs back with their owners (api/access.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from ckptd.core.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from ckptd.core.manifest import MANIFEST, Manifest
from ckptd.core.names import UNKNOWN_OWNER, Owner, check_name, check_step, recorded_owner

from ..files import fsync_dir, read_small, replace_synced, write_synced
from .incoming import Incoming

INCOMING = ".incoming"
HOLDER_MARK = ".holder"
"""In a replica's directory: it came as a step a newer replica references (not its
source's head); only a head's commit decides what stays."""
OWNER = "owner.json"
"""In a replica's directory: the job's owner on its source, as the source said it."""


@dataclass(frozen=True)
class Held:
    """One replica held here."""

    job: str
    source: str
    step: int
    raw: str
    """Its manifest's text."""
    size: int
    timeline: int = 0
    """The job's timeline the step was saved on (core/timeline.py)."""
    begun: int = 0
    """When its reception began, in this daemon's count (0: held at start-up): of two
    receptions from one source at once, the later one begun is the newer save."""
    holders: frozenset[int] = frozenset()
    """The older steps its rank files reference (held here with it)."""
    owner: Owner = UNKNOWN_OWNER
    """The job's owner on its source, as the source said it (core/names.py)."""


class ReplicaStore:
    """The replicas held for other nodes (blocking methods: call them on a thread)."""

    def __init__(self, root: Path, budget: int) -> None:
        self.dir = root / ".replicas"
        self.budget = budget
        self._held: dict[tuple[str, str, int], Held] = {}
        """Every replica held, by (job, source, step). Replaced whole, never changed in
        place: the event loop lists it while the I/O threads commit."""
        self._head: dict[tuple[str, str], int] = {}
        """Per (job, source): the step its source sent last as its newest."""
        self._begun = 0
        """Receptions begun since start-up (orders receptions from one source)."""
        self._reserved: dict[str, int] = {}
        """Bytes of replicas being received, by incoming directory."""
        self._lock = threading.Lock()  # receptions begin and end on several I/O threads

    def load(self) -> int:
        """Empty ``.incoming``, read what is held (a directory that is not a whole
        replica is removed, and so is what the last head written does not need);
        returns the number of replicas."""
        shutil.rmtree(self.dir / INCOMING, ignore_errors=True)
        (self.dir / INCOMING).mkdir(parents=True, mode=0o750)
        for job_dir in sorted(p for p in self.dir.iterdir() if p.name != INCOMING):
            for source_dir in sorted(job_dir.iterdir()):
                found: dict[int, tuple[int, bool, Held]] = {}  # step: written, holder, it
                for step_dir in sorted(source_dir.iterdir()):
                    try:
                        held = self._read(job_dir.name, source_dir.name, step_dir)
                        written = (step_dir / MANIFEST).stat().st_mtime_ns
                    except (OSError, ValueError, InvalidArgument):
                        shutil.rmtree(step_dir, ignore_errors=True)
                        continue
                    found[held.step] = (written, (step_dir / HOLDER_MARK).exists(), held)
                for _, _, held in found.values():
                    self._held = {**self._held, (held.job, held.source, held.step): held}
                # The head written last; holders written after it came for a newer
                # head still to come, and stay (its source sends it again).
                heads = sorted((w, h.step) for w, mark, h in found.values() if not mark)
                if heads:
                    written, head = heads[-1]
                    self._head[(job_dir.name, source_dir.name)] = head
                    # Not after by mtime may still be after: a file's time moves in
                    # clock ticks, so a tie keeps the holder (the next head clears it).
                    later = {n for n, (w, mark, _) in found.items() if mark and w >= written}
                    self._keep(job_dir.name, source_dir.name, head, later)
        return len(self._held)

    def _read(self, job: str, source: str, step_dir: Path) -> Held:
        raw = read_small(step_dir / MANIFEST).decode()
        m = _checked(raw, job, int(step_dir.name), source)
        owner = _read_owner(step_dir / OWNER)
        return Held(
            job, source, m.step, raw, m.size_bytes, m.timeline, 0, frozenset(m.holders()), owner
        )

    def _dir_of(self, held: Held) -> Path:
        return self.dir / held.job / held.source / str(held.step)

    def _needs(self, job: str, source: str, step: int) -> set[int]:
        """``step`` and every step it references, transitively (held or not)."""
        need: set[int] = set()
        todo = [step]
        while todo:
            n = todo.pop()
            if n in need:
                continue
            need.add(n)
            held = self._held.get((job, source, n))
            todo += held.holders if held is not None else ()
        return need

    def _keep(self, job: str, source: str, head: int, also: set[int] | None = None) -> None:
        """Remove the replicas of (job, source) that ``head`` does not need and
        ``also`` does not name (under the lock, or before the store is shared)."""
        need = self._needs(job, source, head) | (also or set())
        gone = [
            h for (j, s, n), h in self._held.items() if (j, s) == (job, source) and n not in need
        ]
        if gone:
            self._held = {k: h for k, h in self._held.items() if h not in gone}
            for held in gone:
                shutil.rmtree(self._dir_of(held), ignore_errors=True)

    @property
    def held_bytes(self) -> int:
        """Bytes of every replica held."""
        return sum(h.size for h in self._held.values())

    def list(self, job: str = "", source: str = "") -> list[Held]:
        """The replicas of ``job`` and ``source`` (empty: any): each source's head and
        the steps it references."""
        return [
            h
            for (j, s, _), h in sorted(self._held.items())
            if (not job or j == job) and (not source or s == source)
        ]

    def begin(
        self,
        job: str,
        step: int,
        raw: str,
        holder_for: int = 0,
        owner: Owner = UNKNOWN_OWNER,
    ) -> Incoming[Held] | Held:
        """Start receiving ``source``'s replica of ``step`` (``raw``: its manifest, whose
        ``node`` is the source, already checked to be the sender; ``owner``: the job's
        owner there, as it says); the replica itself if it is held already (its owner
        updated). Refused if it would not fit the budget, or if it references a step not
        held here. Once received it becomes the source's head, whatever the step numbers
        (the sender is the source, and the source sends its newest save), unless
        ``holder_for`` names the newer step it is sent ahead of."""
        m = _checked(raw, check_name("job", job), check_step(step), None)
        if holder_for and not step < holder_for:
            raise InvalidArgument(f"step {step} cannot hold references of step {holder_for}")
        with self._lock:
            return self._begin(job, step, m, raw, holder_for, owner)

    def _begin(
        self, job: str, step: int, m: Manifest, raw: str, holder_for: int, owner: Owner
    ) -> Incoming[Held] | Held:
        old = self._held.get((job, m.node, step))
        if old is not None and old.raw == raw:
            if owner[1] and owner != old.owner:  # `ckptd own` on the source since
                replace_synced(self._dir_of(old) / OWNER, _owner_bytes(owner))
                old = dataclasses.replace(old, owner=owner)
                self._held = {**self._held, (job, m.node, step): old}
            if not holder_for:  # sent again (its source restarted): held already
                self._head[(job, m.node)] = step
                self._keep(job, m.node, step)
            return old
        self._check_holders(job, m)
        freed = old.size if old else 0
        if not holder_for:  # what the new head will not need goes once it is in
            need = m.holders().union(*(self._needs(job, m.node, h) for h in m.holders()))
            freed = sum(
                h.size for (j, s, n), h in self._held.items()
                if (j, s) == (job, m.node) and (n not in need or n == step)
            )  # fmt: skip
        other = self.held_bytes - freed + sum(self._reserved.values())
        if other + m.size_bytes > self.budget:
            raise ResourceExhausted(
                f"a replica of {m.size_bytes} bytes does not fit: {other} of the "
                f"{self.budget} bytes of peer_budget_bytes are in use on this peer"
            )
        path = self.dir / INCOMING / secrets.token_hex(8)
        path.mkdir(mode=0o750)
        self._reserved[path.name] = m.size_bytes
        self._begun += 1
        return Incoming(self._commit, self._abort, path, m, raw, self._begun, holder_for, owner)

    def _check_holders(self, job: str, m: Manifest) -> None:
        """FailedPrecondition unless every step ``m`` references is held here, with the
        same rank file long enough for each range read from it: a replica is never
        held without the bytes it is restored from."""
        for r in m.ranks:
            for ref in r.refs or ():
                held = self._held.get((job, m.node, int(ref[2])))
                files = {} if held is None else {x.file: x for x in _manifest(held).ranks}
                record = files.get(r.file)
                if record is None or int(ref[3]) + int(ref[1]) > record.size:
                    raise FailedPrecondition(
                        f"the replica of step {m.step} references step {ref[2]}, which this "
                        "peer does not hold (or not that file): send that step first"
                    )

    def path(self, job: str, source: str, step: int, file: str) -> Path:
        """A file of a replica held here (NotFound: not held, or not one of its files)."""
        held = self._held.get((job, source, step))
        if held is None:
            raise NotFound(f"no replica of step {step} of job {job!r} from {source} here")
        if file not in {r.file for r in _manifest(held).ranks}:
            raise NotFound(f"{file!r} is not a file of that replica")
        return self._dir_of(held) / file

    def _commit(self, incoming: Incoming[Held]) -> Held:
        with self._lock:
            return self._commit_locked(incoming)

    def _commit_locked(self, incoming: Incoming[Held]) -> Held:
        m = incoming.manifest
        self._reserved.pop(incoming.path.name, None)
        head = self._head.get((m.job, m.node))
        current = None if head is None else self._held.get((m.job, m.node, head))
        if not incoming.holder_for and current is not None and current.begun > incoming.begun:
            shutil.rmtree(incoming.path, ignore_errors=True)  # one begun later landed first
            return current
        try:
            self._check_holders(m.job, m)  # a head committed meanwhile may have dropped one
        except FailedPrecondition:
            shutil.rmtree(incoming.path, ignore_errors=True)
            raise
        if incoming.holder_for:
            write_synced(incoming.path / HOLDER_MARK, b"")
        if incoming.owner[1]:
            write_synced(incoming.path / OWNER, _owner_bytes(incoming.owner))
        write_synced(incoming.path / MANIFEST, incoming.raw.encode())
        fsync_dir(incoming.path)
        holders = frozenset(m.holders())
        held = Held(
            m.job,
            m.node,
            m.step,
            incoming.raw,
            m.size_bytes,
            m.timeline,
            incoming.begun,
            holders,
            incoming.owner,
        )
        final = self._dir_of(held)
        final.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        shutil.rmtree(final, ignore_errors=True)  # replaced, or a leftover of a crash
        os.rename(incoming.path, final)
        fsync_dir(final.parent)
        self._held = {**self._held, (m.job, m.node, m.step): held}
        if not incoming.holder_for:
            self._head[(m.job, m.node)] = m.step
            self._keep(m.job, m.node, m.step)
        return held

    def _abort(self, incoming: Incoming[Held]) -> None:
        with self._lock:
            self._reserved.pop(incoming.path.name, None)
        shutil.rmtree(incoming.path, ignore_errors=True)


def _checked(raw: str, job: str, step: int, source: str | None) -> Manifest:
    """A peer's manifest, checked like a bucket's, naming ``job`` and ``step`` (and
    ``source`` as its node, if given); ckptd rank files only."""
    m = Manifest.from_json(raw)
    if m.job != job or m.step != step or (source is not None and m.node != source):
        raise InvalidArgument(
            f"the manifest names {m.job!r} step {m.step} of node {m.node!r}, not the "
            f"replica's {job!r} step {step}"
        )
    if m.adopted:
        raise InvalidArgument("adopted directories are not replicated")
    return m


def _owner_bytes(owner: Owner) -> bytes:
    return json.dumps({"owner": owner[0]}).encode()


def _read_owner(path: Path) -> Owner:
    """A replica's recorded owner (none recorded, or unreadable: not known)."""
    try:
        body = json.loads(read_small(path))
        return recorded_owner(body) if isinstance(body, dict) else UNKNOWN_OWNER
    except (OSError, ValueError):
        return UNKNOWN_OWNER


@functools.lru_cache(maxsize=64)
def _parsed(raw: str) -> Manifest:
    return Manifest.from_json(raw)


def _manifest(held: Held) -> Manifest:
    """A held replica's manifest, parsed once (its text was checked when it came)."""
    return _parsed(held.raw)
