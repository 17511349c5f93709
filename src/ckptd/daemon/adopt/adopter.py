"""Adopting checkpoint directories that another framework wrote (Orbax, DCP, ...).

An adopted step is hard-linked file by file into ckptd's own store (a copy when
the source is on another filesystem), so the framework's own deletions (Orbax's
``max_to_keep``) cannot race the drain. Each file is fsynced and its crc32c
recorded in a manifest of kind ``directory``; the step then commits like any
other (LOCAL), drains byte-identical to ``<remote>/<job>/<step>/`` (layout.py)
and is kept or evicted by the same retention.

A watched directory (the job's Orbax directory, ``<root>/.orbax/<job>`` unless
the trainer names another on the same filesystem) is scanned every
``adopt_poll_seconds``: a step directory is adopted once it is finished, by the
framework's own names and commit rule (tree.Layout): for Orbax a plain numeric
name (no ``.orbax-checkpoint-tmp`` suffix) holding ``commit_success.txt``, which
Orbax writes before it renames the tmp directory, so the tree is whole by then;
for torchtitan ``step-<step>`` holding DCP's ``.metadata``. The Hugging Face
Trainer's ``checkpoint-<step>`` has no such file: its callback adopts each one
(Adopt), and a scan never does. A step put back for a restore gets the name its
framework looks for.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.core.errors import (
    Conflict,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from ckptd.core.manifest import KIND_DIRECTORY, Manifest
from ckptd.core.verify import verify_step

from ..catalog import Step
from ..catalog.roles import Saves
from ..files import replace_synced
from ..io import IoPool
from ..local.store import LocalStore, retire_replaced
from ..remote.source import BucketSource
from ..restore.restorer import Restorer
from .paths import (
    DAEMON,
    READ,
    Caller,
    check_tree_readable,
    check_writable,
    make_dirs_for,
    nearest_device,
    open_dir,
    permitted,
    resolve_inside,
)
from .tree import ORBAX, Layout, finished_steps, layout_named, link_tree, orbax_metrics, put_back

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
    caller: Caller = DAEMON
    """Who asked for the watch: its steps are adopted only if that user could read them."""
    layout: Layout = ORBAX
    """How the framework writing there names its steps and finishes them."""


class Adopter:
    """Adoption, watched directories, and putting adopted steps back for a restore."""

    def __init__(
        self,
        catalog: Saves,
        store: LocalStore,
        io: IoPool,
        restorer: Restorer,
        bucket: BucketSource,
        poll_seconds: float,
        adopt_dirs: tuple[Path, ...] = (),
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.io = io
        self.restorer = restorer
        self.bucket = bucket
        self.root = store.root
        self.poll_seconds = poll_seconds
        self.adopt_dirs = list(adopt_dirs)
        self.watches: dict[str, Watch] = {}
        self.path = store.root / WATCH_FILE
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self.adopted = 0

    def default_directory(self, job: str) -> Path:
        """The job's Orbax directory in the local tier."""
        return self.root / ORBAX_DIR / job

    def source(self, caller: Caller, path: str) -> Path:
        """The directory an Adopt call names, resolved, if adoption may read there."""
        return resolve_inside(path, self.adopt_dirs, "adopting")

    def _writable(self, caller: Caller, job: str, directory: str, what: str) -> Path:
        """Where a watch or put-back may write: resolved, inside ``adopt_dirs`` or the
        job's own Orbax directory, and writable by the caller."""
        own = Path(os.path.realpath(self.default_directory(job)))
        path = resolve_inside(directory, [own, *self.adopt_dirs], what) if directory else own
        if path != own:
            check_writable(caller, path)
        return path

    def _outside_store(self, path: Path) -> None:
        """Refuse paths inside ckptd's own store (its watched Orbax directories excepted)."""
        root = self.root.resolve()
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
        caller: Caller = DAEMON,
    ) -> Step:
        """Adopt one finished directory as step ``step`` of ``job`` (LOCAL when this returns),
        if ``caller`` could read every file of it."""
        if not src.is_absolute():
            raise InvalidArgument(f"{src} is not an absolute path; give the daemon one")
        if not src.is_dir():
            raise NotFound(f"{src} is not a directory the daemon can read")
        self._outside_store(src)
        await self.io.run(check_tree_readable, caller, src)
        st = self.catalog.begin(
            job, step, adopted=True, milestone=milestone, metrics=dict(metrics or {})
        )
        commit = await self.io.run(self.store.begin_step, job, step, self.io.run)
        try:
            records = await self.io.run(
                link_tree, src, commit.path, lambda st: permitted(caller, st, READ)
            )
            manifest = Manifest(
                job=job,
                step=step,
                node=self.catalog.node_id,
                world_size=1,
                created_unix=created_unix or time.time(),
                ranks=records,
                kind=KIND_DIRECTORY,
                source=str(src),
                milestone=milestone,
                metrics=dict(metrics or {}),
                timeline=st.timeline,
                forks=st.forks,
            )
            await retire_replaced(self.catalog, self.store, self.io, st)
            await commit.finalize((await self.io.run(manifest.to_json)).encode())
        except BaseException as exc:
            await commit.abort()
            self.catalog.abandoned(st, f"adopting {src} failed: {exc}")
            if isinstance(exc, FileNotFoundError):
                raise NotFound(
                    f"{src} changed while ckptd adopted it ({exc.filename} vanished); "
                    "adopt finished directories only"
                ) from None
            raise
        self.catalog.committed(st, manifest)
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
            raw = json.loads(await self.io.run(self.path.read_text))
            for job, w in raw.items():
                seen = {str(k): int(v) for k, v in w.get("seen", {}).items()}
                who = w.get("caller")
                caller = (
                    Caller(int(who["uid"]), frozenset(int(g) for g in who["groups"]))
                    if who
                    else DAEMON  # written by a release without callers: the operator's
                )
                layout = layout_named(str(w.get("layout", "")))
                self.watches[job] = Watch(job, Path(w["directory"]), seen, caller, layout)
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError, AttributeError, InvalidArgument) as exc:
            log.error("ignoring unreadable %s: %s", self.path, exc)

    async def _save(self) -> None:
        data = {
            j: {
                "directory": str(w.directory),
                "seen": w.seen,
                "caller": None
                if w.caller.privileged
                else {"uid": w.caller.uid, "groups": sorted(w.caller.groups)},
                "layout": w.layout.name,
            }
            for j, w in self.watches.items()
        }
        payload = json.dumps(data, sort_keys=True).encode()
        await self.io.run(replace_synced, self.path, payload)

    async def watch(
        self, job: str, directory: str, caller: Caller = DAEMON, layout: str = ""
    ) -> Path:
        """Watch ``directory`` (default: the job's Orbax directory) for steps finished
        by the rules of ``layout`` (tree.LAYOUTS; empty: Orbax's)."""
        kind = layout_named(layout)
        root = self.root
        path = await self.io.run(self._writable, caller, job, directory, "watching")
        if await self.io.run(nearest_device, path) != os.stat(root).st_dev:
            raise FailedPrecondition(
                f"{path} is on another filesystem than the local tier {root}: ckptd adopts "
                "steps by hard link, so watch a directory on the same disk (the default, "
                f"{self.default_directory(job)}, is)"
            )
        self._outside_store(path)
        await self.io.run(make_dirs_for, caller, path)
        async with self._lock:
            old = self.watches.get(job)
            if old is None or (old.directory, old.caller, old.layout) != (path, caller, kind):
                self.watches[job] = Watch(job, path, caller=caller, layout=kind)
                await self._save()
                log.info("watching %s for finished %s steps of job %r", path, kind.name, job)
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
            found = await self.io.run(finished_steps, w.directory, w.layout)
            names = {p.name for _, p, _ in found}
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
                if self.catalog.get(job, step) is not None:
                    continue  # ckptd has it already (e.g. put back for a restore)
                try:
                    metrics = await self.io.run(orbax_metrics, path)
                    await self.adopt(job, step, path, commit.st_mtime, metrics, caller=w.caller)
                    count += 1
                except (NotFound, InvalidArgument, Conflict, PermissionDenied) as exc:
                    log.warning("not adopting %s: %s", path, exc)
            if changed:
                await self._save()
            return count

    # -- restore side ---------------------------------------------------------------
    async def ensure_local(
        self,
        job: str,
        step: int | None,
        directory: str,
        caller: Caller = DAEMON,
        layout: str = "",
        offer: Callable[[str], bool] = lambda job: False,
    ) -> tuple[Step, Path, bool, bool]:
        """Make sure an adopted step (default: the newest in any tier) is in the watched
        (or given) directory, verified, fetching it from the bucket if need be:
        ``(step, its path there, fetched, linked)``. It is named as ``layout`` (default:
        the watched directory's, else Orbax's) names its steps. ``offer``: the jobs a
        NotFound may name as the one meant (restorer.choose)."""
        w = self.watches.get(job)
        kind = layout_named(layout) if layout else w.layout if w else ORBAX
        if directory:
            directory = str(
                await self.io.run(self._writable, caller, job, directory, "putting back")
            )
        elif job in self.watches and self.watches[job].caller.uid != caller.uid:
            # Another user's watched directory: only its owner's files go there.
            check_writable(caller, self.watches[job].directory)
        await self.bucket.refresh(job)
        while True:
            st = self.restorer.choose(job, step, None, adopted=True, offer=offer)
            self.catalog.served(st)  # the evictor leaves it alone while it is put back
            fetched = not st.local
            if not fetched:
                break
            try:
                await self.bucket.to_local(st, 0, shared_memory=False)
                break
            except DataLoss:
                if step is not None or not st.unusable:
                    raise
                # The bucket source marked its copy unusable: the next older step.
                log.warning(
                    "%s/%d does not verify in the bucket; trying an older step", job, st.step
                )
        path, linked = await self._put_back(job, st, directory, not fetched, caller, kind)
        return st, path, fetched, linked

    async def _put_back(
        self, job: str, st: Step, directory: str, verify: bool, caller: Caller, layout: Layout
    ) -> tuple[Path, bool]:
        """Hard-link an adopted step's files from ckptd's store back into the watched (or
        given) directory, committed by one rename; ``verify``: re-check every file's
        crc32c first (not needed right after a download, which checked each one)."""
        assert st.manifest is not None
        manifest = st.manifest
        w = self.watches.get(job)
        base = Path(directory) if directory else w.directory if w else self.default_directory(job)
        base = Path(os.path.realpath(base))  # a path checked on the way in, or the daemon's
        dest = base / layout.dir_name(st.step)
        if await self.io.run(dest.exists):
            return dest, False
        store_dir = self.store.step_dir(job, st.step)
        with self.catalog.in_use(st):
            if verify:
                bad = await self.io.run(verify_step, store_dir, manifest)
                if bad:
                    raise FailedPrecondition(
                        f"the local copy of step {st.step} of job {job!r} failed its checksum "
                        f"({bad[0]}); `ckptd verify` shows the damage"
                    )
            base_fd = await self.io.run(open_dir, base, caller, True)
            try:
                owner = caller.uid if os.geteuid() == 0 and not caller.privileged else -1
                await self.io.run(put_back, store_dir, manifest, base_fd, dest.name, owner)
            finally:
                os.close(base_fd)
        if w is not None and w.directory == base and w.layout == layout and layout.commit_file:
            async with self._lock:
                with contextlib.suppress(OSError):
                    w.seen[dest.name] = os.stat(dest / layout.commit_file).st_ino
                    await self._save()
        log.info("%s/%d put back into %s", job, st.step, dest)
        return dest, True
