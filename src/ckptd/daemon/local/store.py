"""The local tier on NVMe: where steps live, start-up recovery, eviction, spare files.

Layout::

    <root>/<job>/<step>/manifest.json
    <root>/<job>/<step>/rank-00000.safetensors
    <root>/.staging/<job>.<step>.<token>/   a save in progress; deleted at start-up
    <root>/.cache/                         remote downloads in progress; deleted at start-up
    <root>/.corrupt/                       copies that failed a checksum; deleted at start-up
    <root>/.peers/                         other nodes' parts of steps (for resharding)
    <root>/.spare/                         evicted rank files that later saves overwrite
    <root>/.held/<job>/<step>.<timeline>/  replaced steps that kept steps still read (held.py)

Commit point: the rename of a staging directory to ``<root>/<job>/<step>``
(:class:`~ckptd.daemon.commit.RenameCommit`, ``manifest.json`` written last).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ckptd.core.manifest import MANIFEST, Manifest

from .. import faults
from ..catalog import Step
from ..catalog.roles import Replacing, Saves, Steps
from ..commit import RenameCommit, Runner
from ..files import fsync_dir, read_small
from ..io import IoPool
from .held import HeldCopies, holder_dirs
from .liveness import locked_by_others

log = logging.getLogger("ckptd.localstore")


@dataclass(frozen=True)
class Recovery:
    """What start-up recovery found."""

    manifests: list[Manifest]
    removed_staging: int
    skipped: list[str]


class LocalStore:
    """Filesystem operations of the local tier. Blocking: call from worker threads."""

    def __init__(self, root: Path, spare_max_bytes: int = 0) -> None:
        self.root = root
        self.spare_root = root / ".spare"
        self.spare_max_bytes = spare_max_bytes
        """Evicted rank files kept (up to this many bytes) for new saves to overwrite."""
        self._spares: dict[Path, int] = {}
        self._spare_lock = threading.Lock()
        self._drop_lock = threading.Lock()
        """Held while spares are deleted (:meth:`drop_spares`)."""
        self.staging_root = root / ".staging"
        self.cache_root = root / ".cache"
        self.corrupt_root = root / ".corrupt"
        self.trash_root = root / ".trash"
        self.peers_root = root / ".peers"
        """Other nodes' parts of steps, fetched for restores that reshard across nodes."""
        self.held = HeldCopies(root)
        """Replaced steps' copies that steps on the disk still read (held.py)."""

    def step_dir(self, job: str, step: int) -> Path:
        """Where a committed step lives."""
        return self.root / job / str(step)

    def recover(self) -> Recovery:
        """Remove staging/cache leftovers and rescan committed steps."""
        self.root.mkdir(parents=True, exist_ok=True)
        removed = 0
        leftover_dirs = (
            self.staging_root,
            self.cache_root,
            self.corrupt_root,
            self.trash_root,
            self.spare_root,
            self.peers_root,
        )
        for leftovers in leftover_dirs:
            if leftovers.exists():
                removed += sum(1 for _ in leftovers.iterdir())
                shutil.rmtree(leftovers)
            leftovers.mkdir(mode=0o750)
        fsync_dir(self.root)
        self.held.load()
        manifests: list[Manifest] = []
        skipped: list[str] = []
        for job_dir in sorted(self.root.iterdir()):
            if job_dir.name.startswith(".") or not job_dir.is_dir():
                continue
            for step_dir in job_dir.iterdir():
                if not (step_dir.name.isascii() and step_dir.name.isdigit()):
                    continue  # not a step ("¹8" is isdigit() too): leave it alone
                try:
                    # Checked like a bucket's (Manifest.check): a manifest naming files
                    # outside its step is set aside, never served.
                    manifest = Manifest.from_json(read_small(step_dir / MANIFEST).decode())
                    if manifest.job != job_dir.name or str(manifest.step) != step_dir.name:
                        raise ValueError("manifest names another job or step")
                except (OSError, ValueError) as exc:
                    # Not a commit we can read: set it aside, so the bucket's copy (if
                    # any) can be fetched into its place and restores go on.
                    self.corrupt_root.mkdir(exist_ok=True)
                    shutil.move(
                        str(step_dir),
                        str(self.corrupt_root / f"{job_dir.name}.{step_dir.name}.{time.time_ns()}"),
                    )
                    skipped.append(f"{step_dir}: {exc}; set aside in {self.corrupt_root}")
                    continue
                manifests.append(manifest)
        return Recovery(manifests, removed, skipped)

    def holder_dirs(
        self, manifest: Manifest, occupant: Callable[[int], int | None]
    ) -> dict[int, Path | None]:
        """Where the steps ``manifest``'s references read lie (held.py, ``holder_dirs``;
        ``occupant(step)``: the timeline of the local copy under that number, if any)."""
        return holder_dirs(manifest, partial(self.step_dir, manifest.job), occupant, self.held)

    def holder_dir(
        self, manifest: Manifest, occupant: Callable[[int], int | None]
    ) -> Callable[[int], Path]:
        """:meth:`holder_dirs` as core/verify.py asks for it: a holder not here is given
        its held copy's place, where the check finds it missing."""
        dirs = self.holder_dirs(manifest, occupant)
        timelines = manifest.holder_timelines()
        return lambda step: (
            dirs.get(step) or self.held.path(manifest.job, step, timelines.get(step, 0))
        )

    def begin_step(
        self, job: str, step: int, run: Runner, fetch: bool = False, make: bool = True
    ) -> RenameCommit:
        """A commit of a step: its files go in a fresh directory on the same filesystem
        (``.staging`` for a save, ``.cache`` for a download from the bucket), and
        ``finalize(manifest bytes)`` renames it to :meth:`step_dir`. ``make=False``:
        the directory is made by ``commit.make()`` later (a save: after its answer)."""
        return RenameCommit.beside(
            self.step_dir(job, step),
            self.cache_root if fetch else self.staging_root,
            f"{job}.{step}",
            make=make,
            marker=MANIFEST,
            run=run,
            fault="commit.before_rename",
        )

    def peer_dir(self, job: str, step: int, node: str) -> Path:
        """Where another node's part of a step lives once fetched: one directory per
        job and step (a flat ``<job>.<step>.<node>`` could not tell job ``a`` step 1
        node ``1.x`` from job ``a.1`` step 1 node ``x``)."""
        return self.peers_root / job / str(step) / node

    def begin_peer(self, job: str, step: int, node: str, run: Runner) -> RenameCommit:
        """A commit of another node's part of a step, downloaded into :meth:`peer_dir`."""
        return RenameCommit.beside(
            self.peer_dir(job, step, node),
            self.cache_root,
            f"{job}.{step}.{node}",
            marker=MANIFEST,
            run=run,
        )

    def evict(self, job: str, step: int) -> None:
        """Remove a committed step (see :meth:`evict_many`)."""
        self.evict_many([(job, step)])

    def evict_many(self, keys: list[tuple[str, int]]) -> None:
        """Remove committed steps: each renamed out of view first, the renames made
        durable with one fsync per job directory, then the files deleted.

        Their rank files become spares (up to ``spare_max_bytes``) that later
        saves overwrite in place, except those a client holds mapped.
        """
        faults.hit("evict.begin")
        gone: list[tuple[str, int, Path]] = []
        for job, step in keys:
            final = self.step_dir(job, step)
            trash = self.trash_root / f"{job}.{step}.{secrets.token_hex(4)}"
            try:
                os.rename(final, trash)
            except FileNotFoundError:  # removed by hand: nothing left to evict
                log.warning("%s was already gone when evicted", final)
                continue
            gone.append((job, step, trash))
        if gone:
            faults.hit("evict.renamed")  # out of view; the catalog still lists them
        for parent in {self.step_dir(job, step).parent for job, step, _ in gone}:
            fsync_dir(parent)
        for job, step, trash in gone:
            self._delete(job, step, trash)

    def _delete(self, job: str, step: int, gone: Path) -> None:
        shutil.rmtree(self.peers_root / job / str(step), ignore_errors=True)
        for f in sorted(gone.glob("rank-*.safetensors")):
            if locked_by_others(f):
                # A restore's arrays still view it (the client's shared flock, see
                # client/rank_files.map_held): deleted, never overwritten under them.
                continue
            size = f.stat().st_size
            with self._spare_lock:
                if sum(self._spares.values()) + size > self.spare_max_bytes:
                    break
                spare = self.spare_root / secrets.token_hex(8)
                os.rename(f, spare)
                self._spares[spare] = size
        shutil.rmtree(gone, ignore_errors=True)

    def set_aside(self, job: str, step: int) -> None:
        """Move a corrupt copy out of view into ``.corrupt`` (removed at the next start)."""
        shutil.move(
            str(self.step_dir(job, step)), str(self.corrupt_root / f"{job}.{step}.{time.time_ns()}")
        )

    def take_spare(self, size: int) -> Path | None:
        """The smallest spare file of at least ``size`` bytes, removed from the pool."""
        with self._spare_lock:
            fits = [(n, p) for p, n in self._spares.items() if n >= size]
            if not fits:
                return None
            _, path = min(fits)
            del self._spares[path]
            return path

    def drop_spares(self) -> int:
        """Delete every spare file (the disk is short of space); returns the bytes freed.

        Callers at once (admission's and the evictor's threads) take turns: one that
        finds the spares taken returns once they are deleted, not while their space is
        still held, so it never measures the disk before the space is back (the evictor
        would evict the next step for bytes already on their way)."""
        with self._drop_lock:
            with self._spare_lock:
                spares, self._spares = self._spares, {}
            for path in spares:
                path.unlink(missing_ok=True)
            return sum(spares.values())


async def retire_replaced(
    catalog: Replacing, store: LocalStore, io: IoPool, st: Step, ticket: int | None = None
) -> None:
    """Before ``st`` commits: the local copy of the step its save replaces (an earlier
    timeline's under the same number, core/timeline.py) leaves view once nothing is
    writing or reading it, so the new copy can be renamed into its place. A copy that
    steps still on the disk read (that timeline's incremental steps) is held for them
    (held.py); any other goes. Nothing to do if none."""
    old = catalog.replacing(st)
    if old is None:
        return
    # A save that took the old step as its base holds it until it is LOCAL: after
    # that, it is one of the steps that read it.
    await catalog.quiet(old)
    if old.local:  # not set aside or evicted meanwhile
        readers = reading(catalog, old.job, old.step, old.timeline)
        if readers:
            where = store.step_dir(old.job, old.step)
            await io.run(store.held.keep, where, old.job, old.step, old.timeline, ticket=ticket)
            log.info(
                "%s/%d (timeline %d) is held out of view: steps %s read its files",
                old.job,
                old.step,
                old.timeline,
                ", ".join(str(r.step) for r in readers),
            )
        else:
            await io.run(store.evict, old.job, old.step, ticket=ticket)
    catalog.replaced(old)


def reading(catalog: Steps, job: str, step: int, timeline: int) -> list[Step]:
    """The steps on the disk, or being read or written right now, whose references
    read the save ``step`` of ``timeline`` of ``job``: its copy must stay while any do."""
    return [
        s
        for s in catalog.list(job)
        if (s.local or s.busy) and s.step != step and s.reads().get(step) == timeline
    ]


async def prune_held(catalog: Saves, store: LocalStore, io: IoPool) -> None:
    """Delete the held copies that no step on the disk (or in use) reads any more."""
    if not store.held.keys():
        return  # the common case: nothing held
    wanted = {
        (s.job, n, t) for s in catalog.steps() if s.local or s.busy for n, t in s.reads().items()
    }
    unread = store.held.keys() - wanted
    if not unread:
        return
    for job, step, timeline in await io.run(store.held.drop, unread):
        log.info("%s/%d (timeline %d): held copy deleted, no step reads it", job, step, timeline)
