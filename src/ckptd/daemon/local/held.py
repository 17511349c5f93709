"""Held copies: a replaced step's files, kept out of view while older steps read them.

A save under the number of a step of an earlier timeline replaces it
(core/timeline.py): the old step leaves every listing. But incremental steps of
that earlier timeline may read ranges of its rank files (their references name
a holder by number, on their own history: ``Manifest.holder_timelines``), and
those steps are kept by their own rule (pinned, the abandoned timeline's
retention). So the replaced step's directory is not deleted while a step on
the disk reads it: it moves, whole (manifest included), to::

    <root>/.held/<job>/<step>.<timeline>/

where nothing lists or restores it by number; readers of a reference find it
there when the step under that number is of another timeline (:func:`holder_dir`).
The move is one rename, so a crash leaves the copy either in its step's place
(replaced again at the journal's replay) or here. It is deleted at the first
pass that finds no step on the disk reading it (:func:`prune`).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from ckptd.core.errors import InvalidArgument
from ckptd.core.manifest import MANIFEST, Manifest
from ckptd.core.names import check_name

from ..files import fsync_dir, read_small

log = logging.getLogger("ckptd.localstore")

Key = tuple[str, int, int]
"""``(job, step, timeline)`` of a held copy."""


class HeldCopies:
    """The held copies of one root (``<root>/.held``). Blocking: worker threads."""

    def __init__(self, root: Path) -> None:
        self.dir = root / ".held"
        self._keys: set[Key] = set()
        self._lock = threading.Lock()

    def path(self, job: str, step: int, timeline: int) -> Path:
        """Where the held copy of ``job``'s step ``step`` of ``timeline`` lives."""
        return self.dir / job / f"{step}.{timeline}"

    def load(self) -> set[Key]:
        """Find the held copies at start-up (anything else in the directory, such as a
        copy without its manifest, is removed: a move is one rename, so only a hand
        could have made it)."""
        found: set[Key] = set()
        if self.dir.is_dir():
            for job_dir in self.dir.iterdir():
                for held in job_dir.iterdir() if job_dir.is_dir() else ():
                    key = _parse(job_dir.name, held.name)
                    if key is not None and (held / MANIFEST).is_file():
                        found.add(key)
                    else:
                        log.warning("%s is not a held copy ckptd made: removed", held)
                        shutil.rmtree(held, ignore_errors=True)
        with self._lock:
            self._keys = found
        return set(found)

    def keys(self) -> set[Key]:
        """Every held copy."""
        with self._lock:
            return set(self._keys)

    def has(self, job: str, step: int, timeline: int) -> bool:
        """Whether a copy of that save is held."""
        with self._lock:
            return (job, step, timeline) in self._keys

    def keep(self, step_dir: Path, job: str, step: int, timeline: int) -> None:
        """Move a committed step's directory here (one rename; both directories made
        durable): it leaves view, its files stay for the steps that read them."""
        dest = self.path(job, step, timeline)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():  # held already (a crash after the move, then a replay)
            shutil.rmtree(step_dir, ignore_errors=True)
        else:
            os.rename(step_dir, dest)
        fsync_dir(dest.parent)
        fsync_dir(step_dir.parent)
        with self._lock:
            self._keys.add((job, step, timeline))

    def add(self, job: str, step: int, timeline: int) -> None:
        """Count a copy committed into :meth:`path` by a download."""
        with self._lock:
            self._keys.add((job, step, timeline))

    def drop(self, keys: Iterable[Key]) -> list[Key]:
        """Delete held copies (no step reads them any more); returns those deleted.
        A restore that maps one keeps its pages (the files are only unlinked)."""
        gone = []
        for key in keys:
            with self._lock:
                if key not in self._keys:
                    continue
                self._keys.discard(key)
            shutil.rmtree(self.path(*key), ignore_errors=True)
            gone.append(key)
        return gone


def holder_dirs(
    manifest: Manifest,
    step_dir: Callable[[int], Path],
    occupant: Callable[[int], int | None],
    held: HeldCopies,
) -> dict[int, Path | None]:
    """Where each step ``manifest``'s references read lies on the disk: the holder's
    own directory (``step_dir``) while the step under its number there is of the
    holder's timeline (``occupant``: that step's timeline, None if it has no copy
    here), else its held copy; None where neither is here."""
    out: dict[int, Path | None] = {}
    for step, timeline in manifest.holder_timelines().items():
        if occupant(step) == timeline:
            out[step] = step_dir(step)
        elif held.has(manifest.job, step, timeline):
            out[step] = held.path(manifest.job, step, timeline)
        else:
            out[step] = None
    return out


def holder_dir_on_disk(root: Path, manifest: Manifest) -> Callable[[int], Path]:
    """For readers without a daemon (``ckptd verify``): where each holder of
    ``manifest`` lies under ``root``, told by the manifests on the disk: the step's
    sibling if that is the holder's timeline, else its held copy's place (which a
    reader finds missing if nothing is held there)."""
    timelines = manifest.holder_timelines()
    job_dir = root / manifest.job

    def where(step: int) -> Path:
        sibling = job_dir / str(step)
        timeline = timelines.get(step, 0)
        try:
            if Manifest.from_json(read_small(sibling / MANIFEST).decode()).timeline == timeline:
                return sibling
        except (OSError, ValueError):
            pass
        return root / ".held" / manifest.job / f"{step}.{timeline}"

    return where


def _parse(job: str, name: str) -> Key | None:
    """``(job, step, timeline)`` of a held copy's directory name, None if not one."""
    step, dot, timeline = name.partition(".")
    if not (dot and step.isascii() and step.isdigit() and timeline.isascii()):
        return None
    if not timeline.isdigit():
        return None
    try:
        check_name("job", job)
    except InvalidArgument:
        return None
    return job, int(step), int(timeline)
