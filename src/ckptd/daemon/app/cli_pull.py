"""``ckptd pull``: a complete step from the bucket into a directory, checked, and
whole: an incremental step's images are assembled from the older steps it shares
bytes with (daemon/local/assemble.py), so the directory needs no other step."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

from ckptd.core.errors import CkptdError, NotFound, PermissionDenied
from ckptd.core.manifest import MANIFEST, Manifest
from ckptd.core.timeline import abandoned, merge

from ..commit import RenameCommit
from ..files import write_synced
from ..local.assemble import write_image
from ..remote import held, read
from ..remote.base import Remote
from ..remote.index import marker_entry
from ..remote.layout import FILES_DIR, marker_key
from .cli_jobs import bucket_jobs, did_you_mean, with_hint
from .cli_tiers import bucket_args, load_config, open_bucket
from .cli_view import ByteProgress
from .config import Config


async def _pull(cfg: Config, job: str, step: int | None, dest: Path, node: str | None) -> int:
    remote = open_bucket(cfg)
    try:
        return await _pull_from(remote, cfg, job, step, dest, node)
    finally:
        await remote.close()


async def _pull_from(
    remote: Remote, cfg: Config, job: str, step: int | None, dest: Path, node: str | None
) -> int:
    steps = await read.complete_steps(remote, job)
    if not steps:
        hint = did_you_mean(job, await bucket_jobs(remote), "in the bucket")
        raise NotFound(
            with_hint(f"the bucket {cfg.remote} holds no complete step of job {job!r}", hint)
        )
    if step is None:  # the newest of the live history (core/timeline.py)
        seen = await read.newest_steps(remote, job, 1)
        forks = merge(*(s.forks for s in seen.values()))
        live = [n for n, s in seen.items() if not abandoned(s.timeline or 0, n, forks)]
        step = max(live or steps)
    if step not in steps:
        raise CkptdError(
            f"step {step} of job {job!r} is not complete in {cfg.remote}; "
            f"complete steps: {sorted(steps)[-10:]}"
        )
    found = steps[step]
    nodes = sorted(found.nodes) if node is None else [node]
    for n in nodes:
        if n not in found.nodes:
            raise CkptdError(f"node {n!r} has no complete copy of step {step}")
        # The manifest of the save the node's marker commits, not a stale write of an
        # earlier save under this number (then: refused, never pulled as this step).
        committed = marker_entry(
            step, found.adopted, await remote.get_bytes(marker_key(job, step, n, found.adopted))
        )
        _, raw, manifest = await read.node_manifest(
            remote, job, step, {n}, None, n, found.adopted, committed.timeline
        )
        target = dest if len(nodes) == 1 else dest / n
        _writable_dir(target)
        if any(target.iterdir()):
            raise CkptdError(f"{target} is not empty; pull into a new directory")
        holders = await _holders(remote, job, step, n, manifest, steps)
        total = manifest.size_bytes + sum(h.size_bytes for h in holders.values())
        with ByteProgress(f"{job}/{step}/{n}", total) as progress:
            if manifest.adopted:
                await _pull_tree(remote, job, step, n, manifest, target, progress)
            elif holders:
                manifest = await _pull_whole(remote, n, manifest, holders, target, progress)
            else:
                await read.download_files(remote, job, step, n, manifest, target, progress)
                await asyncio.to_thread(write_synced, target / MANIFEST, raw)  # the manifest last
        print(
            f"pulled {job} step {step} ({n}) into {target}: {len(manifest.ranks)} files, "
            f"{manifest.size_bytes} bytes, crc32c verified"
            + (" (the adopted tree as its framework wrote it)" if manifest.adopted else "")
            + (
                f" (whole: what it shares with steps {sorted(holders)} copied in)"
                if holders
                else ""
            )
        )
    return 0


async def _holders(
    remote: Remote,
    job: str,
    step: int,
    node: str,
    manifest: Manifest,
    steps: dict[int, Any],
) -> dict[int, Manifest]:
    """The manifests of the older steps ``manifest``'s references read (an incremental
    step's), this node's part of each; an error naming one the bucket lacks."""
    out: dict[int, Manifest] = {}
    for older, timeline in sorted(manifest.holder_timelines().items()):
        found = steps.get(older)
        if found is not None and node in found.nodes:
            with contextlib.suppress(NotFound, FileNotFoundError):
                got = await read.node_manifest(
                    remote, job, older, {node}, None, node, False, timeline
                )
                out[older] = got[2]
                continue
        try:  # replaced by a later timeline's save: its files are held (remote/held.py)
            out[older] = (await held.held_manifest(remote, job, node, older, timeline))[1]
        except FileNotFoundError:
            raise CkptdError(
                f"step {step} of job {job!r} reads part of its data from step {older}, which "
                f"the bucket does not hold complete for node {node!r}; pull another step "
                "(ckptd ls --remote lists them)"
            ) from None
    return out


async def _pull_whole(
    remote: Remote,
    node: str,
    manifest: Manifest,
    holders: dict[int, Manifest],
    target: Path,
    progress: ByteProgress,
) -> Manifest:
    """An incremental step pulled whole: its files and its holders' downloaded (each
    checked) beside ``target``, each rank's image assembled into ``target`` and
    checked against the image crc32c recorded at commit, and a manifest of whole
    files written last. A pulled step needs no other step."""
    job, step = manifest.job, manifest.step
    staging = target.parent / f".{target.name}.ckptd-pull.{os.getpid()}"
    await asyncio.to_thread(shutil.rmtree, staging, True)  # an earlier pull's, cut short
    staging.mkdir(mode=0o750)
    try:
        parts = {step: manifest, **holders}
        for n, m in parts.items():
            (staging / str(n)).mkdir()
            await read.download_files(remote, job, n, node, m, staging / str(n), progress)
        ranks = []
        for r in manifest.ranks:
            if not r.incremental:
                os.replace(staging / str(step) / r.file, target / r.file)
                ranks.append(r)
                continue
            files = {n: staging / str(n) / _file_of(parts[n], r.rank) for n in r.holders()}
            own = staging / str(step) / r.file
            bad = await asyncio.to_thread(
                write_image, own, r, files, manifest.shards, target / r.file
            )
            if bad:
                raise CkptdError(f"step {step} of job {job!r} could not be made whole: {bad[0]}")
            ranks.append(
                dataclasses.replace(
                    r,
                    size=r.image_bytes,
                    crc32c=r.image_crc,
                    runs=None,
                    refs=None,
                    image_size=None,
                    image_crc32c=None,
                )
            )
        pulled = dataclasses.replace(manifest, ranks=ranks, increment=0)
        await asyncio.to_thread(write_synced, target / MANIFEST, pulled.to_json().encode())
        return pulled
    finally:
        await asyncio.to_thread(shutil.rmtree, staging, True)


def _file_of(manifest: Manifest, rank: int) -> str:
    """The file of ``rank`` in ``manifest`` (a holder holds every rank it is named for)."""
    return next(r.file for r in manifest.ranks if r.rank == rank)


async def _pull_tree(
    remote: Remote,
    job: str,
    step: int,
    node: str,
    manifest: Manifest,
    target: Path,
    progress: ByteProgress,
) -> None:
    """An adopted step's tree, byte-identical, as ``target`` itself (what its framework
    reads: a Hugging Face ``checkpoint-N``, an Orbax step), not ckptd's own layout of
    it (``files/`` beside a manifest). Downloaded beside ``target`` and renamed into
    place whole, so a half-pulled tree is never mistaken for a checkpoint."""
    staging = target.parent / f".{target.name}.ckptd-pull.{os.getpid()}"
    await asyncio.to_thread(shutil.rmtree, staging, True)  # an earlier pull's, cut short
    staging.mkdir(mode=0o750)
    try:
        await read.download_files(remote, job, step, node, manifest, staging, progress)
        target.rmdir()  # empty (checked): the tree takes its place
        await RenameCommit(target, staging / FILES_DIR).finalize()
    finally:
        await asyncio.to_thread(shutil.rmtree, staging, True)


def _writable_dir(target: Path) -> None:
    """Make ``target`` (and its parents) if missing; raise :class:`PermissionDenied`,
    naming it, if this user may not create files in it. Checked before any byte is
    downloaded, so a pull that cannot land fails at once, in one line."""
    try:
        target.mkdir(parents=True, exist_ok=True)
    except PermissionError as exc:
        raise _cannot_write(exc.filename or target, exc) from None
    if not os.access(target, os.W_OK | os.X_OK):
        raise _cannot_write(target, PermissionError(13, os.strerror(13)))


def _cannot_write(path: object, exc: OSError) -> PermissionDenied:
    return PermissionDenied(
        f"cannot write {path}: {exc.strerror or exc}; pull into a directory your user may "
        "create files in (DEST is made if missing, else it must be empty), or run as a "
        "user that may write there"
    )


def cmd_pull(args: argparse.Namespace) -> int:
    """Download a complete step from the bucket into a directory, verified."""
    dest = Path(args.dest)
    try:
        return asyncio.run(_pull(load_config(args), args.job, args.step, dest, args.node))
    except PermissionError as exc:
        # Past the up-front check (a file:// bucket this user may not read, or a mode
        # changed meanwhile): still one line that names the path, not a traceback.
        raise PermissionDenied(
            f"pull of {args.job!r} into {dest} failed: {exc.strerror or exc}"
            + (f": {exc.filename}" if exc.filename else "")
            + "; run as a user that may read the bucket and write the destination"
        ) from None


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``pull`` on the main parser."""
    p = sub.add_parser("pull", help="download a complete step from the bucket into a directory")
    p.add_argument("job", help="the training job's name")
    p.add_argument(
        "dest",
        help="directory to create (must be empty); an adopted step (a framework's own "
        "checkpoint directory) becomes DEST itself, its files as the framework wrote them",
    )
    p.add_argument("--step", type=int, help="default: the newest complete step")
    p.add_argument("--node", help="only this node's part (default: every node's)")
    bucket_args(p)
    p.set_defaults(fn=cmd_pull)
