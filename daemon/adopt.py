"""Adopting checkpoint directories that another framework wrote (Orbax, DCP, ...).

An adopted step is hard-linked file by file into ckptd's own store (a copy when
the source is on another filesystem), so the framework's own deletions (Orbax's
``max_to_keep``) cannot race the drain. Each file is fsynced and its crc32c
recorded in a manifest of kind ``directory``; the step then commits like any
other (LOCAL), drains byte-identical to ``<remote>/<job>/<step>/`` (layout.py)
and is kept or evicted by the same retention.

A watched directory (the job's Orbax directory, ``<root>/.orbax/<job>`` unless
the trainer names another on the same filesystem) is scanned every
``adopt_poll_seconds``: a step directory is adopted once it is finished, which
for Orbax means a plain numeric name (Orbax's default step names; no
``.orbax-checkpoint-tmp`` suffix) holding ``commit_success.txt``. Orbax writes
that file and then renames the tmp directory, so the tree is whole by then.

Watches and the step directories already seen persist in ``<root>/.watched.json``,
so a step ckptd has since evicted is not adopted again after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.proto import ckptd_pb2 as pb

from . import localstore
from .adopt_tree import finished_steps, link_out, link_tree, orbax_metrics
from .errors import Conflict, FailedPrecondition, InvalidArgument, NotFound
from .layout import COMMIT_FILE
from .manifest import KIND_DIRECTORY, Manifest
from .node import Node, StepState
from .restore import verify_step

log = logging.getLogger("ckptd.adopt")

ORBAX_DIR = ".orbax"
WATCH_FILE = ".watched.json"


@dataclass
class Watch:
    """One watched directory and the step directories in it already dealt with."""

    job: str
    directory: Path
    seen: dict[str, int] = field(default_factory=dict)
    """Step directory name -> inode of its commit file when it was adopted or skipped."""


class Adopter:
    """Adoption, watched directories, and putting adopted steps back for a restore."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.poll_seconds = node.config.adopt_poll_seconds
        self.watches: dict[str, Watch] = {}
        self.path = node.config.root / WATCH_FILE
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self.adopted = 0

    def default_directory(self, job: str) -> Path:
        """The job's Orbax directory in the local tier."""
        return self.node.config.root / ORBAX_DIR / job

    def _outside_store(self, path: Path) -> None:
        """Refuse paths inside ckptd's own store (its watched Orbax directories excepted)."""
        root = self.node.config.root.resolve()
        real = path.resolve()
        if real.is_relative_to(root) and not real.is_relative_to(root / ORBAX_DIR):
            raise InvalidArgument(
                f"{path} is inside the daemon's own store {root}; adopt directories written "
                f"elsewhere, or let Orbax write into {root / ORBAX_DIR}/<job>"
            )

    # -- adoption ---------------------------------------------------------------------
    async def adopt(
        self,
        job: str,
        step: int,
        src: Path,
        created_unix: float = 0.0,
        metrics: dict[str, float] | None = None,
        milestone: bool = False,
    ) -> StepState:
        """Adopt one finished directory as step ``step`` of ``job`` (LOCAL when this returns)."""
        node = self.node
        if not src.is_absolute():
            raise InvalidArgument(f"{src} is not an absolute path; give the daemon one")
        if not src.is_dir():
            raise NotFound(f"{src} is not a directory the daemon can read")
        self._outside_store(src)
        old = node.steps.get((job, step))
        if old is not None and old.state != pb.SAVE_STATE_FAILED:
            raise Conflict(
                f"step {step} of job {job!r} already exists here ({pb.SaveState.Name(old.state)}); "
                "adopt it under a new step number"
            )
        st = StepState(
            job,
            step,
            pb.SAVE_STATE_STAGING,
            handoff_at=time.time(),
            adopted=True,
            milestone=milestone,
            metrics=dict(metrics or {}),
        )
        node.steps[(job, step)] = st
        staging = await node.run_io(node.store.new_staging_dir, job, step)
        try:
            records = await node.run_io(link_tree, src, staging)
            manifest = Manifest(
                job=job,
                step=step,
                node=node.config.node_id,
                world_size=1,
                created_unix=created_unix or time.time(),
                ranks=records,
                shards=[],
                kind=KIND_DIRECTORY,
                source=str(src),
                milestone=milestone,
                metrics=dict(metrics or {}),
            )
            await node.run_io(node.store.commit, staging, manifest)
        except BaseException as exc:
            await node.run_io(node.store.discard, staging)
            node.steps.pop((job, step), None)
            if isinstance(exc, FileNotFoundError):
                raise NotFound(
                    f"{src} changed while ckptd adopted it ({exc.filename} vanished); "
                    "adopt finished directories only"
                ) from None
            raise
        node.mark_local(st, manifest)
        self.adopted += 1
        log.info(
            "%s/%d adopted from %s: %d files, %d bytes, LOCAL in %.3f s",
            job,
            step,
            src,
            len(records),
            manifest.size_bytes,
            st.local_at - st.handoff_at,
        )
        return st

    # -- watched directories ------------------------------------------------------------
    async def load(self) -> None:
        """Read the persisted watches (start-up)."""
        try:
            raw = json.loads(await self.node.run_io(self.path.read_text))
            for job, w in raw.items():
                seen = {str(k): int(v) for k, v in w.get("seen", {}).items()}
                self.watches[job] = Watch(job, Path(w["directory"]), seen)
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.error("ignoring unreadable %s: %s", self.path, exc)

    async def _save(self) -> None:
        data = {j: {"directory": str(w.directory), "seen": w.seen} for j, w in self.watches.items()}
        payload = json.dumps(data, sort_keys=True).encode()
        await self.node.run_io(localstore.replace_synced, self.path, payload)

    async def watch(self, job: str, directory: str) -> Path:
        """Watch ``directory`` (default: the job's Orbax directory) for finished steps."""
        root = self.node.config.root
        path = Path(directory) if directory else self.default_directory(job)
        if not path.is_absolute():
            raise InvalidArgument(f"{directory!r} is not an absolute path")
        await self.node.run_io(lambda: path.mkdir(parents=True, exist_ok=True, mode=0o750))
        if os.stat(path).st_dev != os.stat(root).st_dev:
            raise FailedPrecondition(
                f"{path} is on another filesystem than the local tier {root}: ckptd adopts "
                "steps by hard link, so watch a directory on the same disk (the default, "
                f"{self.default_directory(job)}, is)"
            )
        self._outside_store(path)
        async with self._lock:
            old = self.watches.get(job)
            if old is None or old.directory != path:
                self.watches[job] = Watch(job, path)
                await self._save()
                log.info("watching %s for finished steps of job %r", path, job)
        await self.scan_job(job)
        return path

    def stop(self) -> None:
        """Ask :meth:`run` to return after the adoption under way."""
        self._stop.set()

    async def run(self) -> None:
        """Scan every watched directory until stopped."""
        while not self._stop.is_set():
            for job in list(self.watches):
                try:
                    await self.scan_job(job)
                except Exception:
                    log.exception("scanning the watched directory of job %r failed", job)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.poll_seconds)

    async def scan_job(self, job: str) -> int:
        """Adopt the finished steps of one watched directory; returns how many."""
        async with self._lock:
            w = self.watches.get(job)
            if w is None:
                return 0
            found = await self.node.run_io(finished_steps, w.directory)
            names = {str(s) for s, _, _ in found}
            changed = False
            for gone in set(w.seen) - names:  # the framework deleted it: forget it
                del w.seen[gone]
                changed = True
            count = 0
            for step, path, commit in found:
                if self._stop.is_set():
                    break
                if w.seen.get(path.name) == commit.st_ino:
                    continue
                w.seen[path.name] = commit.st_ino
                changed = True
                if (job, step) in self.node.steps:
                    continue  # ckptd has it already (e.g. put back for a restore)
                try:
                    metrics = await self.node.run_io(orbax_metrics, path)
                    await self.adopt(job, step, path, commit.st_mtime, metrics)
                    count += 1
                except (NotFound, InvalidArgument, Conflict) as exc:
                    log.warning("not adopting %s: %s", path, exc)
            if changed:
                await self._save()
            return count

    # -- restore side ---------------------------------------------------------------
    async def ensure_local(
        self, job: str, st: StepState, directory: str, verify: bool = True
    ) -> tuple[Path, bool]:
        """Put an adopted step with a local copy in ckptd's store back into the watched
        (or given) directory; returns the step's path there and whether it was linked.
        ``verify``: re-check every file's crc32c first (not needed right after a
        download, which checked each one)."""
        node = self.node
        assert st.manifest is not None
        w = self.watches.get(job)
        base = Path(directory) if directory else w.directory if w else self.default_directory(job)
        dest = base / str(st.step)
        if await node.run_io(dest.exists):
            return dest, False
        store_dir = node.store.step_dir(job, st.step)
        st.busy += 1
        try:
            if verify:
                bad = await node.run_io(verify_step, store_dir, st.manifest)
                if bad:
                    raise FailedPrecondition(
                        f"the local copy of step {st.step} of job {job!r} failed its checksum "
                        f"({bad[0]}); `ckptd verify` shows the damage"
                    )
            await node.run_io(lambda: base.mkdir(parents=True, exist_ok=True))
            await node.run_io(link_out, store_dir, st.manifest, dest)
        finally:
            st.busy -= 1
        if w is not None and w.directory == base:
            async with self._lock:
                with contextlib.suppress(OSError):
                    w.seen[dest.name] = os.stat(dest / COMMIT_FILE).st_ino
                    await self._save()
        log.info("%s/%d put back into %s", job, st.step, dest)
        return dest, True
