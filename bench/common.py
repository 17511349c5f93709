"""Helpers shared by the benchmark scripts under ``bench/``.

- :class:`Daemon`: a real ``ckptd serve`` subprocess on a private root and socket (the
  launcher the tests and ``ckptd demo`` use too).
- Timing: :func:`timed`, :func:`median_of`, :func:`summarize`, :func:`settle`.
- Page cache: :func:`drop_caches` (fsync + ``POSIX_FADV_DONTNEED`` on every file).
- Output: :func:`print_table` (stdout) and :func:`write_results`
  (``bench/results/<name>.json`` with machine information).

Scripts import this module as ``common`` (``bench/`` is on ``sys.path`` when a
script there is run as ``python bench/bench_x.py``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ckptd.daemon.app.launcher import DaemonProcess

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
DEFAULT_WORK_DIR = REPO_ROOT / ".bench-tmp"
"""Scratch space on the same disk as the repo (gitignored); never /dev/shm."""
SETTLE_SECONDS = 0.5

T = TypeVar("T")


# -- scratch space ---------------------------------------------------------------
@contextlib.contextmanager
def run_directory(work_dir: Path, name: str) -> Iterator[Path]:
    """A fresh ``<work_dir>/<name>-<pid>`` for one run, removed afterwards (with
    ``work_dir`` too if this run created it)."""
    created = not work_dir.exists()
    work_dir.mkdir(parents=True, exist_ok=True)
    run_dir = work_dir / f"{name}-{os.getpid()}"
    run_dir.mkdir()
    try:
        yield run_dir
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                work_dir.rmdir()


# -- daemon --------------------------------------------------------------------
class Daemon(DaemonProcess):
    """The shared launcher (``ckptd.daemon.app.launcher``) with the benchmarks' defaults:
    a 6 GiB staging budget and the log beside the root; ``stop()`` also cleans up."""

    def __init__(
        self,
        root: Path,
        socket: Path | None = None,
        *,
        staging_budget: str = "6GiB",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        super().__init__(
            root,
            socket,
            staging_budget=staging_budget,
            extra_args=extra_args,
            env=env,
            log_path=log_path,
            start_timeout=start_timeout,
        )

    @property
    def args(self) -> list[str]:
        """The ``ckptd serve`` command line (recorded in the results)."""
        return self.command()

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM the daemon and wait for it (SIGKILL after ``timeout``); returns its status."""
        rc = super().stop(timeout)
        self.close()
        return rc

    def event_time(self, job: str, step: int, kind: int) -> float | None:
        """When the daemon recorded ``kind`` (a ``StepEvent``) for ``job``/``step``."""
        found = [e.time_unix for e in self.events(job) if e.step == step and e.kind == kind]
        return found[-1] if found else None


# -- timing --------------------------------------------------------------------
def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Run ``fn`` once; returns ``(seconds, result)`` measured with ``perf_counter``."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def settle(seconds: float = SETTLE_SECONDS) -> None:
    """What every arm does before it is timed: collect the garbage earlier arms left (a
    process that imported torch, jax and Orbax holds ~340,000 objects: a full
    collection falling into the next arm cost it ~150 ms), flush dirty pages, then
    let the disk idle."""
    gc.collect()
    os.sync()
    time.sleep(seconds)


def summarize(samples: Sequence[float]) -> dict[str, Any]:
    """``{"median", "min", "max", "n", "samples"}`` of a list of seconds."""
    if not samples:
        return {"median": None, "min": None, "max": None, "n": 0, "samples": []}
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
        "samples": list(samples),
    }


def median_of(
    fn: Callable[[], object], n: int, setup: Callable[[], object] | None = None
) -> dict[str, Any]:
    """Time ``fn`` ``n`` times (``setup`` runs untimed before each) and :func:`summarize`."""
    samples = []
    for _ in range(n):
        if setup is not None:
            setup()
        samples.append(timed(fn)[0])
    return summarize(samples)


# -- page cache ----------------------------------------------------------------
def _files_under(path: Path) -> Iterator[Path]:
    if path.is_file():
        yield path
        return
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            yield Path(dirpath, name)


def drop_caches(path: str | os.PathLike[str]) -> int:
    """Evict every file under ``path`` from the page cache; returns the files touched.

    Each file is fsynced first (``DONTNEED`` skips dirty pages). Pages still
    mapped by a live mmap stay resident, so drop references to restored arrays
    before calling this.
    """
    count = 0
    for file in _files_under(Path(path)):
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    return count


# -- output --------------------------------------------------------------------
def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> None:
    """Print an aligned text table; floats are shown with 3 decimals, None as ``-``."""

    def cell(v: object) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}"
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in text)]) for i, h in enumerate(headers)]
    if title:
        print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    print("  ".join("-" * w for w in widths))
    for r in text:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    sys.stdout.flush()


def _git_commit() -> str | None:
    """HEAD's commit read straight from ``.git`` (no git process is run)."""
    git = REPO_ROOT / ".git"
    try:
        if git.is_file():  # a worktree: "gitdir: <path>"
            git = (REPO_ROOT / git.read_text().split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(":", 1)[1].strip()
        for base in (git, _common_git_dir(git)):
            if (base / ref).is_file():
                return (base / ref).read_text().strip()
            packed = base / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split(" ", 1)[0]
    except (OSError, IndexError):
        return None
    return None


def source_digest() -> str:
    """sha256 over the daemon's and client's sources as they are in the work tree now.

    The git commit does not show uncommitted edits; this does (and a change during a
    run, when compared at its start and end).
    """
    import hashlib

    h = hashlib.sha256()
    for sub in ("daemon", "client", "proto"):
        for path in sorted((REPO_ROOT / "src" / "ckptd" / sub).rglob("*.py")):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            h.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + data + b"\0")
    return h.hexdigest()[:16]


def _common_git_dir(git: Path) -> Path:
    common = git / "commondir"
    return (git / common.read_text().strip()).resolve() if common.is_file() else git


def _mount_of(path: Path) -> dict[str, str]:
    """Device and filesystem type of the mount holding ``path``."""
    best: dict[str, str] = {}
    target = str(path.resolve())
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, *_ = line.split()
                inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best.get("mount", "")):
                    best = {"device": dev, "mount": mnt, "fstype": fstype}
    except OSError:
        pass
    return best


def machine_info(work_dir: Path | None = None) -> dict[str, Any]:
    """CPU count, memory, kernel, Python/numpy versions, date, git commit, work-dir mount."""
    mem_total = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_total = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import numpy

        numpy_version: str | None = numpy.__version__
    except ImportError:
        numpy_version = None
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "mem_total_bytes": mem_total,
        "python": platform.python_version(),
        "numpy": numpy_version,
        "platform": platform.platform(),
        "hostname": platform.node(),
        "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "source_sha256": source_digest(),
    }
    if work_dir is not None:
        info["work_dir"] = str(work_dir)
        info["work_dir_mount"] = _mount_of(work_dir)
    return info


def write_results(name: str, results: dict[str, Any], work_dir: Path | None = None) -> Path:
    """Write ``results`` and machine info to ``bench/results/<name>.json``; returns its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    doc = {"name": name, "machine": machine_info(work_dir), **results}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path
