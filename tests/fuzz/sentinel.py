"""The directory tree around a fuzzed daemon, and whether the daemon touched it.

The sentinel directory holds what absolute paths in requests point at: a directory
to adopt, a finished Orbax step, special files, symlinks into the root and out of
the sentinel. Before the run every path under the base directory (less the
daemon's root, bucket and log) and every top-level entry of /tmp are recorded;
after it nothing may have appeared or vanished except under the directories a
successful Watch or EnsureLocal named (those RPCs create them by design).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckptd.daemon.local.staging import SHM_DIR, segment_prefix


def shm_segments(root: Path) -> int:
    """Shared-memory segments of the daemon on ``root``."""
    return len(list(SHM_DIR.glob(segment_prefix(root) + "*")))


def tree(base: Path, skip: set[Path]) -> set[str]:
    """Every path under ``base`` (symlinks not followed), less the subtrees in ``skip``."""
    found: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(base):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d not in skip]
        found.update(str(here / n) for n in dirnames + filenames if here / n not in skip)
    return found


class Sentinel:
    """The sentinel tree under ``base``, and the snapshot it is checked against."""

    def __init__(self, base: Path, root: Path, skip: set[Path]) -> None:
        self.base, self.root, self.skip = base, root, skip
        self.dir = base / "sentinel"
        s = self.dir
        (s / "adopt-src" / "sub").mkdir(parents=True)
        (s / "adopt-src" / "a.bin").write_bytes(b"a" * 100)
        (s / "adopt-src" / "sub" / "b.json").write_text("{}")
        (s / "orbax" / "7").mkdir(parents=True)
        (s / "orbax" / "7" / "commit_success.txt").write_text("ok")
        (s / "orbax" / "7" / "data").write_bytes(b"d" * 10)
        (s / "special").mkdir()
        os.mkfifo(s / "special" / "fifo")
        (s / "special" / "link").symlink_to("/etc/hostname")
        (s / "afile").write_text("not a directory")
        (s / "link-root").symlink_to(root)
        (s / "link-up").symlink_to("..")
        self.allowed: set[str] = set()
        """Real paths a successful Watch or EnsureLocal created (or may create under)."""
        self._tmp_before = set(os.listdir("/tmp"))
        self._before = tree(base, skip)

    def valid_paths(self) -> list[str]:
        """Absolute paths a request may name and succeed with."""
        s = self.dir
        return [str(s / "adopt-src"), str(s / "orbax"), str(s / "watch"), str(s / "ensure")]

    def hostile_paths(self) -> list[str]:
        """Special files, symlinks, the store itself, over-long and odd paths."""
        s, root = self.dir, self.root
        return [
            str(s / "special"),
            str(s / "afile"),
            str(s / "link-root"),
            str(s / "link-root" / "fz-a"),
            str(s / "link-up" / "escaped"),
            str(s / "adopt-src" / ".." / ".." / "escaped"),
            str(root),
            str(root / ".orbax"),
            str(root / ".staging"),
            str(s / ("x" * 256)),
            str(s / "y" / ("x" * 255)),
            str(s) + "/" + "d/" * 2100,
            str(s / "nul\x00byte"),
            "relative/dir",
            ".",
            "..",
            "",
        ]

    def allow(self, path: str) -> None:
        """A directory the daemon was asked to create (by where it really resolves)."""
        self.allowed.add(os.path.realpath(path))

    def check(self, generated_names: set[str]) -> dict[str, Any]:
        """What appeared or vanished outside the root, the bucket and allowed directories;
        and new top-level /tmp entries named like something the fuzzer generated."""
        after = tree(self.base, self.skip)
        allowed = tuple(self.allowed)
        new = after - self._before
        created = sorted(p for p in new if not any(_under(p, a) for a in allowed))
        vanished = sorted(self._before - after)
        new_tmp = set(os.listdir("/tmp")) - self._tmp_before
        stray_tmp = sorted(n for n in new_tmp if n in generated_names)
        return {
            "created": created[:50],
            "vanished": vanished[:50],
            "stray_tmp_entries": stray_tmp[:50],
            "created_by_watch_or_ensure_local": len(new) - len(created),
            "ok": not (created or vanished or stray_tmp),
        }


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")
