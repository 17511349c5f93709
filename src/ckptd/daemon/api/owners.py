"""Job owner records: ``<root>/.owners/<job>`` holds the uid a job belongs to.

A root written by a daemon that kept no owner records has no ``.owners``
directory. Opening it must not leave its jobs open to every user (the first to
touch one would own it), so start-up gives each job found there the owner its
files show: the one uid, other than the operators', that owns files of the job
(adopted files hard-linked in, the job's watched directory created for its
user) or asked for its watch (``<root>/.watched.json`` records who). Where the
daemon wrote every file itself and no such uid exists, or several do, the job is
recorded as :data:`UNASSIGNED`: closed to everyone but operators until an
operator assigns it with ``ckptd own JOB USER`` (:func:`assign`). The records
are built in a side directory renamed into place at the end, so a start-up that
dies halfway does it again from the start instead of leaving some jobs without
a record.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from ckptd.core.errors import InvalidArgument
from ckptd.core.names import check_name

from ..files import fsync_dir, replace_synced, write_synced

log = logging.getLogger("ckptd.access")

OWNERS_DIR = ".owners"
UNASSIGNED = -1
"""The owner of a job whose owner could not be told: no uid matches it."""
ORBAX_DIR = ".orbax"
"""Watched directories of jobs (adopt/adopter.py): created for the watching user."""
WATCH_FILE = ".watched.json"
"""The persisted watches (adopt/adopter.py), each with the uid that asked for it."""
MAX_FILES_LOOKED_AT = 10_000
"""Files of one job whose owner is looked at: enough to find an adopted file."""


def read_records(directory: Path) -> dict[str, int]:
    """The owner records in ``directory`` (a malformed one is logged and skipped)."""
    owners: dict[str, int] = {}
    for entry in os.scandir(directory):
        try:
            owners[check_name("job", entry.name)] = read_one(Path(entry.path))
        except (InvalidArgument, ValueError, OSError) as exc:
            log.warning("ignoring owner record %s: %s", entry.path, exc)
    return owners


def read_one(path: Path) -> int:
    """The uid in one owner record."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return int(os.read(fd, 32).decode().strip())
    finally:
        os.close(fd)


def infer(root: Path, operators: frozenset[int]) -> dict[str, int]:
    """Owners for the jobs of a root that has no owner records (see the module doc)."""
    owners: dict[str, int] = {}
    watchers = _watch_callers(root / WATCH_FILE)
    dirs = {
        e.name
        for e in os.scandir(root)
        if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
    }
    for name in sorted(dirs | set(watchers)):
        try:
            job = check_name("job", name)
        except InvalidArgument:
            continue
        uids = _file_uids(root / job, root / ORBAX_DIR / job) | watchers.get(job, set())
        uids -= operators
        if len(uids) == 1:
            owners[job] = uids.pop()
            log.warning("job %r had no owner record; its files say uid %d", job, owners[job])
        else:
            owners[job] = UNASSIGNED
            log.warning(
                "job %r had no owner record and its files name %s; it stays closed to "
                "non-operators until `ckptd own %s USER` assigns it",
                job,
                f"uids {sorted(uids)}" if uids else "no user",
                job,
            )
    return owners


def _watch_callers(path: Path) -> dict[str, set[int]]:
    """Job -> the uid that asked for its watch, from the adopter's record."""
    try:
        raw = json.loads(path.read_bytes())
        return {
            str(job): {int(w["caller"]["uid"])}
            for job, w in raw.items()
            if isinstance(w, dict) and isinstance(w.get("caller"), dict)
        }
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("cannot read the watches in %s for job owners: %s", path, exc)
        return {}


def _file_uids(*tops: Path) -> set[int]:
    uids: set[int] = set()
    for path in _walk(*tops):
        try:
            uids.add(os.lstat(path).st_uid)
        except OSError:
            continue
    return uids


def _walk(*tops: Path) -> Iterator[str]:
    seen = 0
    for top in tops:
        for dirpath, dirnames, filenames in os.walk(top):
            for name in (*dirnames, *filenames):
                seen += 1
                if seen > MAX_FILES_LOOKED_AT:
                    return
                yield os.path.join(dirpath, name)


def write_all(directory: Path, owners: dict[str, int]) -> None:
    """Create ``directory`` holding ``owners``, all at once (side directory, rename)."""
    side = directory.with_name(directory.name + ".new")
    shutil.rmtree(side, ignore_errors=True)  # a start-up that died while building it
    side.mkdir(mode=0o750)
    for job, uid in owners.items():
        write_synced(side / job, str(uid).encode(), 0o640)
    fsync_dir(side)
    os.rename(side, directory)
    fsync_dir(directory.parent)


def assign(root: Path, job: str, uid: int) -> int | None:
    """Give ``job`` to ``uid`` (``ckptd own``); returns the uid it had before, if any.
    A job that already has an owner is refused: taking a job from its user is not
    what this is for."""
    job = check_name("job", job)
    directory = root / OWNERS_DIR
    if not directory.is_dir():
        raise InvalidArgument(
            f"{root} has no {OWNERS_DIR} directory; start `ckptd serve` on it once (it "
            "records the owners its files show), then assign the jobs it left closed"
        )
    path = directory / job
    try:
        before = read_one(path)
    except FileNotFoundError:
        before = None
    except (OSError, ValueError):
        before = UNASSIGNED  # unreadable: replaced, as the operator asks
    if before is not None and before != UNASSIGNED:
        raise InvalidArgument(
            f"job {job!r} already belongs to uid {before}; `ckptd own` assigns only jobs "
            "that have no owner (to share it, add the uid to allow_uids or the job to "
            "shared_jobs in the ckptd config)"
        )
    replace_synced(path, str(uid).encode(), 0o640)
    return before
