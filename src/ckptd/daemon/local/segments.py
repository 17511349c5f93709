"""Where staging segments live, and which files found there the daemon trusts.

Segments are files in a directory of the daemon's own under the shm directory
(mode 0700): /dev/shm is writable by everyone, and a name there that the daemon
did not create could be anyone's file, or a link to one. Inside a directory only
the daemon's uid can write to, every name is the daemon's. Clients never open
segments by name: the process a lease is granted to gets a descriptor over its
session (api/access.py), so no other uid needs to enter the directory.

The directory cannot be squatted: its name is random (``ckptd-<32 hex>.d``) and
made with ``mkdir``, which fails if the name exists, and it is recorded in the
root (:data:`DIR_RECORD`), so a daemon restarted after a crash finds the
segments the journal names. A directory under the recorded name that is not the
daemon's (a user made it after a clean stop removed ours) is passed over and
logged, and a fresh one made; so is the name earlier releases derived from the
root's path (:func:`legacy_dir`), which any user could compute and make first.

A segment found on disk at start-up (the journal's replay of a crashed daemon's
handoffs) is mapped only if it is what this daemon would have made: a regular
file, reached without following a link, with one link, owned by the daemon's
uid, mode 0600, of the size the journal recorded. Anything else is refused and
never mapped. Segments of an older daemon, made directly in the shm directory,
pass the same checks and are moved into the directory before they are used.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import stat
from pathlib import Path

from ckptd.core.errors import ResourceExhausted

from .shm import SharedMapping

__all__ = [
    "DIR_RECORD",
    "SEGMENT_GRANULE",
    "SHM_DIR",
    "SegmentRefused",
    "claim_dir",
    "create_segment",
    "legacy_dir",
    "open_trusted",
    "recorded_dir",
    "remove_legacy",
]

log = logging.getLogger("ckptd.staging")

SHM_DIR = Path("/dev/shm")
SEGMENT_GRANULE = 2 * 2**20
"""Segments grow in 2 MiB steps so a state that grows a little reuses its segment."""
SEGMENT_MODE = 0o600
DIR_RECORD = ".shm-dir"
"""The file in the root that names the segment directory (its name, one line)."""
_DIR_NAME = re.compile(r"ckptd-[0-9a-f]{12,64}\.d")


class SegmentRefused(ValueError):
    """A file under a segment's name that the daemon cannot vouch for; never mapped."""


def legacy_dir(prefix: str, shm_dir: Path = SHM_DIR) -> Path:
    """The directory earlier releases kept a root's segments in, named after the root's
    path (``prefix`` from :func:`.lease.segment_prefix`): any user can compute it.

    Its name does not start with ``prefix``, so a glob for an older daemon's
    segments (``<shm>/<prefix>*``) never matches the directory itself."""
    return shm_dir / f"{prefix.rstrip('-')}.d"


def recorded_dir(root: Path, shm_dir: Path = SHM_DIR) -> Path | None:
    """The segment directory the root's record names (it may be gone); None if the
    root records none, or nothing that could be one."""
    return _named(root / DIR_RECORD, shm_dir)


def _named(record: Path, shm_dir: Path) -> Path | None:
    try:
        name = record.read_text().strip()
    except (OSError, ValueError):  # none, or unreadable: a new directory is recorded
        return None
    return shm_dir / name if _DIR_NAME.fullmatch(name) else None


def _not_ours(path: Path) -> str:
    """Why the existing ``path`` cannot be the daemon's directory; empty if it is."""
    st = os.lstat(path)
    euid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        return f"it is a symbolic link (owned by uid {st.st_uid})"
    if not stat.S_ISDIR(st.st_mode):
        return f"it is not a directory (owned by uid {st.st_uid})"
    if st.st_uid != euid:
        return f"it belongs to uid {st.st_uid}, not to this daemon's uid {euid}"
    if stat.S_IMODE(st.st_mode) != 0o700:
        # Ours, but others could create names in it: close it. What they left is
        # refused at adoption and removed as a leftover.
        os.chmod(path, 0o700)
    return ""


def claim_dir(shm_dir: Path, record: Path | None, legacy: Path | None = None) -> Path:
    """The daemon's segment directory: the one ``record`` names if it is there and the
    daemon's (a crashed daemon's segments are in it), else a new one made exclusively
    under a random name and recorded (``record`` None: not recorded).

    ``legacy``: where an earlier release kept them (:func:`legacy_dir`); taken, and
    recorded, only while the root records none. A directory under either name that
    is not the daemon's is passed over and logged, never used. Raises OSError if no
    directory can be made or recorded."""
    named = _named(record, shm_dir) if record is not None else None
    for path in (named,) if named is not None else (legacy,):
        if path is None or not os.path.lexists(path):
            continue
        why = _not_ours(path)
        if not why:
            if path != named and record is not None:
                _record(record, path.name)
            return path
        log.warning(
            "passing over %s for shared memory: %s; anyone may create names in %s, so "
            "ckptd makes a directory of its own under a random name",
            path,
            why,
            shm_dir,
        )
    while True:
        path = shm_dir / f"ckptd-{secrets.token_hex(16)}.d"
        try:
            os.mkdir(path, 0o700)  # fails if the name exists: nobody else's directory
        except FileExistsError:
            continue
        os.chmod(path, 0o700)  # mkdir's mode is narrowed by the umask; set it exactly
        break
    if record is not None:
        try:
            _record(record, path.name)
        except OSError:
            path.rmdir()
            raise
    return path


def _record(record: Path, name: str) -> None:
    """Write ``name`` to ``record`` atomically and durably (a crash leaves the old one
    or the new one, never a part)."""
    tmp = record.with_name(record.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, f"{name}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, record)
    dfd = os.open(record.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _why_untrusted(st: os.stat_result, size: int | None) -> str:
    """Why a segment file cannot be the daemon's; empty if it can."""
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to this daemon's uid {os.geteuid()}"
    if stat.S_IMODE(st.st_mode) != SEGMENT_MODE:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}, not {SEGMENT_MODE:04o}"
    if st.st_nlink != 1:
        return f"it has {st.st_nlink} hard links, not 1"
    if size is not None and st.st_size != size:
        return f"it holds {st.st_size} bytes; the journal recorded {size}"
    if st.st_size <= 0 or st.st_size % SEGMENT_GRANULE:
        return f"its size {st.st_size} is not a whole number of {SEGMENT_GRANULE}-byte granules"
    return ""


def open_trusted(path: Path, size: int | None, legacy: Path | None = None) -> SharedMapping:
    """Map the segment at ``path`` after checking it is one the daemon made.

    ``size``: what the journal recorded (None: a record that has no size).
    ``legacy``: where an older daemon kept it; used (and moved to ``path``) only
    when ``path`` does not exist. Raises :class:`SegmentRefused` saying why a
    file is not trusted, FileNotFoundError if there is none."""
    src = path
    if legacy is not None and not os.path.lexists(path) and os.path.lexists(legacy):
        src = legacy
    try:
        # O_NOFOLLOW: a link is refused, never followed (a root daemon would read and
        # write whatever it points at). O_NONBLOCK: a FIFO never blocks the start.
        fd = os.open(src, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SegmentRefused("it is a symbolic link") from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.ENXIO, errno.EISDIR):
            raise SegmentRefused(f"it cannot be opened as a file ({exc.strerror})") from None
        raise
    try:
        st = os.fstat(fd)
        why = _why_untrusted(st, size)
        if why:
            raise SegmentRefused(why)
        if src != path:
            # Checked through the descriptor, so the name can only be ours: in the
            # sticky shm directory nobody else may rename or remove a file we own.
            os.rename(src, path)
            moved = os.lstat(path)
            if (moved.st_dev, moved.st_ino) != (st.st_dev, st.st_ino):
                raise SegmentRefused(f"{src} changed while it was moved into {path.parent}")
            log.info("moved segment %s of an older ckptd into %s", src.name, path.parent)
        return SharedMapping(fd, st.st_size)
    finally:
        os.close(fd)


def create_segment(path: Path, size: int, populate: bool) -> SharedMapping:
    """Make a new segment file at ``path`` (0600, ``size`` bytes) and map it.

    ``populate``: allocate every page now. ResourceExhausted if the shm
    filesystem cannot hold it."""
    # O_EXCL | O_NOFOLLOW: a new file of ours, never something already there.
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, SEGMENT_MODE)
    try:
        os.ftruncate(fd, size)
        try:
            if populate:
                # Allocates and zeroes every page now, in the kernel, so no save pays for it.
                os.posix_fallocate(fd, 0, size)
            return SharedMapping(fd, size, populate)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise ResourceExhausted(
                f"cannot allocate {size} bytes of shared memory in {path.parent}: "
                f"{exc.strerror}; free space there or lower staging_budget_bytes"
            ) from None
    finally:
        os.close(fd)


def remove_legacy(shm_dir: Path, prefix: str) -> int:
    """Delete segments an older daemon made directly in ``shm_dir`` and nobody adopted.

    Only plain files of this daemon's uid are removed; anything else under the
    prefix is someone else's and is left alone (and logged)."""
    removed = 0
    for path in shm_dir.glob(prefix + "*"):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            path.unlink(missing_ok=True)
            removed += 1
        else:
            log.warning(
                "left %s alone: it carries this root's segment prefix but is not a file of "
                "this daemon's uid %d (uid %d); nothing will use it",
                path,
                os.geteuid(),
                st.st_uid,
            )
    return removed
