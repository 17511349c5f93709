"""Where adoption may act, and on whose behalf (see api/access.py for the model).

Adopt reads a directory tree, Watch creates and scans a directory, EnsureLocal
writes into one. The daemon often runs with more rights than its callers, so
each acts only
- inside a directory the operator listed in ``adopt_dirs`` (or the job's own
  Orbax directory under the root), judged on the *resolved* path, so a symlink
  cannot lead out; and
- on what the calling process could read (adopt) or write (watch, put back)
  itself, judged from the kernel-reported uid and groups of its session against
  each file's owner, group and mode bits (ACLs that grant more are not honoured:
  the check errs towards refusing).
The files adopted are checked again on the inode actually linked or copied
(tree.py), so swapping a path for a symlink after the check gains nothing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ckptd.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from ckptd.core.names import check_path

READ, WRITE, SEARCH = 4, 2, 1


@dataclass(frozen=True)
class Caller:
    """Who asked: a session's uid and groups (``privileged``: root or the daemon's uid)."""

    uid: int
    groups: frozenset[int]
    privileged: bool = False


DAEMON = Caller(os.geteuid(), frozenset(os.getgroups()) | {os.getegid()}, privileged=True)
"""The daemon acting for itself (start-up scans)."""


def permitted(caller: Caller, st: os.stat_result, want: int) -> bool:
    """Whether ``caller`` has ``want`` (READ/WRITE/SEARCH bits) on a file with stat ``st``."""
    if caller.privileged:
        return True
    if st.st_uid == caller.uid:
        bits = (st.st_mode >> 6) & 7
    elif st.st_gid in caller.groups:
        bits = (st.st_mode >> 3) & 7
    else:
        bits = st.st_mode & 7
    return bits & want == want


def resolve_inside(path: str | Path, allowed: list[Path], what: str) -> Path:
    """``path`` with every symlink resolved, if that lies inside one of ``allowed``.

    The path need not exist yet (a directory to create): its existing part is
    resolved and the rest must be plain names.
    """
    given = Path(path)
    if not given.is_absolute():
        raise InvalidArgument(f"{str(path)[:200]!r} is not an absolute path; give the daemon one")
    if any(part in ("..", ".") for part in given.parts) or "\0" in str(path):
        raise InvalidArgument(f"{str(path)[:200]!r} contains '.', '..' or NUL; give a plain path")
    check_path("path", str(path))  # too long for the kernel: refused now, not ENAMETOOLONG later
    real = Path(os.path.realpath(given))
    for base in allowed:
        if real == base or real.is_relative_to(base):
            return real
    listed = ", ".join(str(d) for d in allowed) or "none"
    raise PermissionDenied(
        f"{what} {given} resolves to {real}, outside the directories this daemon may "
        f"{'read' if what == 'adopting' else 'write'} (adopt_dirs: {listed}); ask the operator "
        "to list its directory in adopt_dirs in the ckptd config"
    )


def check_tree_readable(caller: Caller, src: Path) -> None:
    """Refuse a tree with a directory ``caller`` cannot list or a file it cannot read."""
    if caller.privileged:
        return
    for d, _, names in os.walk(src):
        if not permitted(caller, os.lstat(d), READ | SEARCH):
            raise PermissionDenied(f"{d} is not readable by uid {caller.uid}; adopt your own files")
        for name in names:
            st = os.lstat(os.path.join(d, name))
            if stat.S_ISREG(st.st_mode) and not permitted(caller, st, READ):
                raise PermissionDenied(
                    f"{os.path.join(d, name)} is not readable by uid {caller.uid}; "
                    "adopt your own files"
                )


def check_writable(caller: Caller, path: Path) -> None:
    """Refuse unless ``caller`` could create entries in ``path`` (or, if it does not
    exist yet, in its nearest existing ancestor)."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    st = os.stat(probe)
    if not stat.S_ISDIR(st.st_mode):
        raise FailedPrecondition(f"{probe} is not a directory")
    if not permitted(caller, st, WRITE | SEARCH):
        raise PermissionDenied(
            f"{probe} is not writable by uid {caller.uid}; use your own directory"
        )


def nearest_device(path: Path) -> int:
    """The device ``path`` is (or, not existing yet, would be created) on."""
    while not path.exists():
        path = path.parent
    return os.stat(path).st_dev


DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir(path: Path, caller: Caller, create: bool = False) -> int:
    """A descriptor of directory ``path`` (absolute, resolved), reached from ``/`` one
    component at a time without following a symlink: what the daemon then writes
    relative to it lands there even if a component is swapped for a symlink later.

    ``create``: make missing components (0750); when the daemon is root they
    belong to ``caller``, who writes into them (Orbax into a watched directory).
    """
    fd = os.open("/", DIR_FLAGS)
    try:
        for part in path.parts[1:]:
            try:
                nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o750, dir_fd=fd)
                nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
                if os.geteuid() == 0 and not caller.privileged:
                    os.fchown(nfd, caller.uid, -1)
            except (NotADirectoryError, OSError) as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise PermissionDenied(
                    f"{path}: {part!r} is a symlink or not a directory; give a plain directory"
                ) from None
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def make_dirs_for(caller: Caller, path: Path) -> None:
    """``mkdir -p path`` without following symlinks (see :func:`open_dir`)."""
    os.close(open_dir(path, caller, create=True))
