"""The filesystem side of adoption: which step directories are finished, and
hard-linking trees into ckptd's store and back out (see adopter.py)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckptd.core import checksum
from ckptd.core.errors import InvalidArgument, PermissionDenied
from ckptd.core.health import RESERVED_PREFIX
from ckptd.core.manifest import Manifest, RankRecord
from ckptd.core.names import check_tree_path

from ..commit import COMMIT_FILE, FILES_DIR
from .paths import DIR_FLAGS

MAX_FILES = 1_000_000


@dataclass(frozen=True)
class Layout:
    """How a framework names its step directories, and when one is finished.

    ``commit_file``: the file the framework writes last (atomically) into a
    finished step directory, so a scan may adopt any directory holding it. Empty:
    no file says so (the Hugging Face Trainer writes ``checkpoint-N/`` in place
    with no commit file, ``trainer_state.json`` by ``open("w")``, and other
    ranks' RNG files with no barrier before ``on_save``): only the trainer can
    tell, by adopting the directory itself; a scan never adopts one.
    """

    name: str
    prefix: str
    commit_file: str

    def dir_name(self, step: int) -> str:
        """The directory the framework writes (and, on restore, looks for) ``step`` in."""
        return f"{self.prefix}{step}"

    def step_of(self, name: str) -> int | None:
        """The step a directory name stands for, None if the framework would not
        write that name (Orbax's ``7.orbax-checkpoint-tmp-…``, zero-padded numbers)."""
        if not name.startswith(self.prefix):
            return None
        digits = name[len(self.prefix) :]
        # str(int(d)) == d: a zero-padded name would not match <job>/<step> in the
        # bucket. isascii: "¹8" is isdigit() too, and int() refuses it.
        if not (digits.isascii() and digits.isdigit() and str(int(digits)) == digits):
            return None
        return int(digits)


ORBAX = Layout("orbax", "", COMMIT_FILE)
"""Orbax: ``<step>/``, finished once ``commit_success.txt`` is in it (written before
Orbax renames its tmp directory into place)."""
HF = Layout("hf", "checkpoint-", "")
"""The Hugging Face Trainer: ``checkpoint-<step>/``, finished when the trainer's
callback adopts it (ckptd.client.hf)."""
TORCHTITAN = Layout("torchtitan", "step-", ".metadata")
"""torchtitan (DCP's FileSystemWriter): ``step-<step>/``, finished once DCP renamed
``.metadata`` into place (its coordinator does after every rank wrote its data)."""
ACCELERATE = Layout("accelerate", "checkpoint_", "")
"""HF accelerate's ``save_state`` with automatic naming: ``checkpoint_<iteration>/``,
finished when the caller adopts it (ckptd.client.accelerate)."""
LAYOUTS = {layout.name: layout for layout in (ORBAX, HF, TORCHTITAN, ACCELERATE)}


def layout_named(name: str) -> Layout:
    """The layout called ``name`` (empty: Orbax's)."""
    try:
        return LAYOUTS[name or ORBAX.name]
    except KeyError:
        raise InvalidArgument(
            f"unknown step-directory layout {name[:40]!r}; use one of {', '.join(LAYOUTS)}"
        ) from None


def finished_steps(
    directory: Path, layout: Layout = ORBAX
) -> list[tuple[int, Path, os.stat_result]]:
    """``(step, path, stat of its commit file)`` of each finished step directory, oldest
    first (the commit file's inode tells a re-saved step apart, its mtime is the step's
    time). None for a layout without a commit file: only its trainer says a step is
    finished."""
    if not layout.commit_file:
        return []
    found = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        step = layout.step_of(entry.name)
        if step is None or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            commit = os.stat(Path(entry.path) / layout.commit_file)
        except (FileNotFoundError, NotADirectoryError):
            continue
        found.append((step, Path(entry.path), commit))
    return sorted(found, key=lambda t: t[0])


def tree_files(src: Path) -> list[str]:
    """Relative paths of every regular file under ``src``; anything else is refused."""
    files: list[str] = []
    for d, dirs, names in os.walk(src, onerror=_raise):
        for name in dirs + names:
            path = Path(d) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode) or not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise InvalidArgument(
                    f"{path} is a symlink or special file; ckptd adopts trees of regular "
                    "files and directories only (copy it into a plain directory first)"
                )
            if stat.S_ISREG(mode):
                rel = str(path.relative_to(src))
                # Refused now, not when the upload or a restore meets the name.
                check_tree_path("file", f"{FILES_DIR}/{rel}")
                files.append(rel)
        if len(files) > MAX_FILES:
            raise InvalidArgument(f"{src} holds over {MAX_FILES} files; adopt a smaller tree")
    if not files:
        raise InvalidArgument(f"{src} holds no files; there is nothing to adopt")
    return sorted(files)


def orbax_metrics(step_dir: Path) -> dict[str, float]:
    """The numeric metrics Orbax saved with a step (``save(..., metrics=...)`` with a
    ``best_fn``: the ``metrics`` item), so ckptd's ``KeepBest`` / ``BestN`` retention
    can rank adopted steps too."""
    for path, field_name in (
        (step_dir / "metrics" / "metrics", None),
        (step_dir / "_CHECKPOINT_METADATA", "metrics"),
    ):
        try:
            raw = json.loads(path.read_text())
            metrics = raw.get(field_name) if field_name else raw
            found = {
                str(k): float(v)
                for k, v in (metrics or {}).items()
                if isinstance(v, int | float)
                and not isinstance(v, bool)
                and not str(k).startswith(RESERVED_PREFIX)  # the daemon's own (health)
            }
        except (OSError, ValueError, AttributeError):
            continue
        if found:
            return found
    return {}


def _raise(exc: OSError) -> None:
    raise exc


def link_tree(
    src: Path, staging: Path, may_read: Callable[[os.stat_result], bool] = lambda st: True
) -> list[RankRecord]:
    """Hard-link (or copy) every file of ``src`` under ``staging/files``, fsync each,
    and record its size and crc32c (one read). The directories are fsynced by the
    commit (:class:`~ckptd.daemon.commit.RenameCommit`).

    ``may_read`` judges the inode actually adopted (opened without following a
    symlink, and for a link, the very inode linked), so a path swapped after the
    caller's permission check cannot smuggle in a file the caller could not read.
    """
    same_fs = os.stat(src).st_dev == os.stat(staging).st_dev
    records = []
    made: set[Path] = set()
    for i, rel in enumerate(tree_files(src)):
        dst = staging / FILES_DIR / rel
        if dst.parent not in made:
            dst.parent.mkdir(parents=True, exist_ok=True)
            made.add(dst.parent)
        src_fd = os.open(src / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(src_fd)
            if not stat.S_ISREG(st.st_mode) or not may_read(st):
                raise PermissionDenied(f"{src / rel} is not a regular file the caller may read")
            if same_fs:
                os.link(src / rel, dst)
                got = os.lstat(dst)
                if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
                    raise InvalidArgument(f"{src / rel} changed while ckptd adopted it")
            else:
                with open(dst, "xb") as out, os.fdopen(os.dup(src_fd), "rb") as inp:
                    shutil.copyfileobj(inp, out, 8 * 2**20)
        finally:
            os.close(src_fd)
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)  # the framework may not have (Orbax does not)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        crc = checksum.of_file(dst)
        records.append(RankRecord(i, f"{FILES_DIR}/{rel}", size, crc, None))
    return records  # the commit fsyncs every directory of the tree


def put_back(store_dir: Path, manifest: Manifest, base_fd: int, name: str, owner: int = -1) -> None:
    """Hard-link an adopted step's files from ckptd's store into directory ``name``
    under ``base_fd`` (see paths.open_dir; copied when that is on another filesystem
    than the store, as a trainer's output directory may be): built under a hidden
    name relative to directory descriptors, never following a symlink, then one
    rename, fsynced, so the framework never sees a partial step and a swapped path
    cannot redirect a link out of the directory. ``owner`` (a uid, -1: leave as is): the uid the
    directories and files are given to, so a trainer of another user than the
    daemon can read what was put back for it (its job's own files)."""
    tmp = f".ckptd-{name}.{time.time_ns()}"
    os.mkdir(tmp, 0o750, dir_fd=base_fd)
    try:
        top = os.open(tmp, DIR_FLAGS, dir_fd=base_fd)
        opened: dict[tuple[str, ...], int] = {(): top}
        try:
            for r in manifest.ranks:
                *dirs, leaf = r.file.removeprefix(FILES_DIR + "/").split("/")
                if any(p in ("", ".", "..") for p in (*dirs, leaf)):
                    raise InvalidArgument(f"manifest names {r.file!r}; refusing to put it back")
                for depth in range(1, len(dirs) + 1):
                    key = tuple(dirs[:depth])
                    if key not in opened:
                        parent = opened[key[:-1]]
                        with contextlib.suppress(FileExistsError):
                            os.mkdir(key[-1], 0o750, dir_fd=parent)
                        opened[key] = os.open(key[-1], DIR_FLAGS, dir_fd=parent)
                _link_or_copy(store_dir / r.file, leaf, opened[tuple(dirs)])
                if owner >= 0:
                    os.chown(leaf, owner, -1, dir_fd=opened[tuple(dirs)], follow_symlinks=False)
            for fd in opened.values():
                if owner >= 0:
                    os.fchown(fd, owner, -1)
                os.fsync(fd)
        finally:
            for fd in opened.values():
                os.close(fd)
        os.rename(tmp, name, src_dir_fd=base_fd, dst_dir_fd=base_fd)
        os.fsync(base_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp, dir_fd=base_fd)
        raise


def _link_or_copy(src: Path, leaf: str, dir_fd: int) -> None:
    """Hard-link ``src`` as ``leaf`` in ``dir_fd``, or copy it there (fsynced) when the
    directory is on another filesystem; never following a symlink at ``leaf``."""
    try:
        os.link(src, leaf, dst_dir_fd=dir_fd)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    out = os.open(leaf, flags, 0o640, dir_fd=dir_fd)
    try:
        with open(src, "rb") as inp, os.fdopen(os.dup(out), "wb") as dst:
            shutil.copyfileobj(inp, dst, 8 * 2**20)
        os.fsync(out)
    finally:
        os.close(out)
