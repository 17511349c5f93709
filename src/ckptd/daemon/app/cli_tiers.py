"""``ckptd verify``: work on the tiers directly, no daemon needed (as ``ckptd pull``,
cli_pull.py, does with what this module opens)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from ckptd.core.errors import CkptdError, PermissionDenied
from ckptd.core.manifest import MANIFEST, Manifest
from ckptd.core.verify import verify_step
from ckptd.core.wire import Connection
from ckptd.proto import ckptd_pb2 as pb

from ..local.held import holder_dir_on_disk
from ..remote import held, read
from ..remote.backends import open_remote
from ..remote.base import Remote
from ..remote.layout import file_key, manifest_key, parse_marker
from . import config as config_mod
from .cli_jobs import bucket_jobs, did_you_mean, local_jobs
from .cli_view import ByteProgress, print_table, socket_arg
from .config import Config

_WHERE = ("root", "remote", "remote_endpoint_url")


class NothingToVerify(CkptdError):
    """``ckptd verify`` found no copy to check: exit 3, not a silent success (a wrong
    root or an unset bucket must not pass for a healthy one), nor 1 (corrupt)."""

    exit_code = 3


def load_config(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Config:
    """Where the tiers are: the flags, ``--config``/``$CKPTD_CONFIG`` and ``CKPTD_*``
    as ``ckptd serve`` reads them; with none of those given, the running daemon's
    root and remote (asked on ``--socket``), so ``ckptd pull JOB DIR`` on a node just
    works; failing that, the defaults."""
    env = os.environ if env is None else env
    flags = {k: getattr(args, k, None) for k in _WHERE}
    config_mod.refuse_unknown_env(env)
    overrides: list[str] = []
    cfg = config_mod.load(Path(args.config) if args.config else None, env, flags, overrides)
    for line in overrides:
        print(f"ckptd: warning: {line}", file=sys.stderr)
    chosen = (
        args.config
        or env.get(config_mod.ENV_PREFIX + "CONFIG")
        or any(v is not None for v in flags.values())
        or any(env.get(config_mod.ENV_PREFIX + k.upper()) for k in _WHERE)
    )
    if chosen:
        return cfg
    try:
        st = Connection(getattr(args, "socket", None), timeout=10.0).get_status(
            pb.GetStatusRequest()
        )
    except CkptdError:
        return cfg  # no daemon here: the defaults (said when nothing is found)
    print(
        f"using the running daemon's root {st.root}"
        + (f" and bucket {st.remote}" if st.remote else " (it has no bucket)")
        + f" (asked on {st.socket})",
        file=sys.stderr,
    )
    return dataclasses.replace(
        cfg,
        root=Path(st.root),
        remote=st.remote,
        remote_endpoint_url=st.remote_endpoint_url or cfg.remote_endpoint_url,
    )


def open_bucket(cfg: Config) -> Remote:
    """The bucket of ``cfg`` (close it when done); a clear error without one."""
    if not cfg.remote:
        raise config_mod.ConfigError(
            "no remote configured: pass --remote s3://BUCKET/PREFIX (or gs://, file://) "
            "or set CKPTD_REMOTE"
        )
    return open_remote(
        cfg.remote, cfg.remote_endpoint_url, cfg.part_size_bytes, cfg.drain_concurrency
    )


async def _verify_remote(cfg: Config, job: str | None) -> list[tuple[str, str]]:
    remote = open_bucket(cfg)
    try:
        return await _verify_remote_in(remote, job)
    finally:
        await remote.close()


async def _verify_remote_in(remote: Remote, job: str | None) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    intact: dict[tuple[str, str, int], bool] = {}  # each copy checked: (job, node, step)
    holders: dict[int, tuple[str, str, dict[int, int]]] = {}  # row -> (step, timeline) read
    timelines: dict[tuple[str, str, int], int] = {}  # each copy's timeline
    markers = [m for m in map(parse_marker, await remote.list_keys(job + "/" if job else "")) if m]
    for j, step, node, adopted in markers:
        base = f"{j}/{step}/{node}"
        try:
            key = manifest_key(j, step, node, adopted)
            raw = await remote.get_bytes(key)
            manifest = read.parse_remote_manifest(raw, key, j, step, node, adopted)
            timelines[(j, node, step)] = manifest.timeline
            if manifest.holders():
                holders[len(rows)] = (j, node, manifest.holder_timelines())
            bad = [
                r.file
                for r in manifest.ranks
                if await remote.native_crc32c(
                    file_key(
                        j, step, node, r.file, adopted, manifest.data_layout, manifest.timeline
                    )
                )
                != r.crc32c
            ]
        except PermissionError as exc:  # a file:// bucket this user may not read
            rows.append((f"remote {base}", f"UNREADABLE {exc.filename or key}: {exc.strerror}"))
            intact[(j, node, step)] = False
            continue
        except (OSError, ValueError) as exc:
            bad = [str(exc)]
        intact[(j, node, step)] = not bad
        rows.append((f"remote {base}", "OK" if not bad else "CORRUPT " + ", ".join(bad)))
    # An incremental copy restores only with the older steps its references read
    # (core/increments.py): one the bucket lacks or holds damaged, and it cannot.
    held_ok: dict[tuple[str, str, int, int], bool | None] = {}
    for at, (j, node, steps) in holders.items():
        lost = []
        for h, timeline in sorted(steps.items()):
            if timelines.get((j, node, h)) == timeline:
                ok, known = intact.get((j, node, h), False), True
            else:  # a copy a later timeline's save replaced: held (remote/held.py)
                copy = (j, node, h, timeline)
                if copy not in held_ok:
                    held_ok[copy] = await _held_intact(remote, *copy)
                ok, known = held_ok[copy] is True, held_ok[copy] is not None
            if not ok:
                lost.append(f"its references' step {h} is {'damaged' if known else 'missing'}")
        if lost:
            name, state = rows[at]
            rows[at] = (name, ("CORRUPT " if state == "OK" else state + ", ") + ", ".join(lost))
    return rows


async def _held_intact(
    remote: Remote, job: str, node: str, step: int, timeline: int
) -> bool | None:
    """Whether ``node``'s held copy of ``step`` of ``timeline`` is in the bucket with
    every file's crc32c as its manifest says (False: damaged; None: no such copy)."""
    try:
        _, manifest = await held.held_manifest(remote, job, node, step, timeline)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return False
    try:
        for r in manifest.ranks:
            key = file_key(job, step, node, r.file, False, manifest.data_layout, timeline)
            if await remote.native_crc32c(key) != r.crc32c:
                return False
    except (OSError, ValueError):
        return False
    return True


def _entries(path: Path) -> list[Path]:
    """A directory's entries, sorted; none if it is missing. A directory this user may
    not list raises PermissionError: an empty answer would pass for an empty tier."""
    try:
        return sorted(path.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _local_steps(root: Path, job: str | None) -> list[tuple[str, Path, Manifest | None, str]]:
    """Committed steps under ``root`` (those with a manifest): each one's name in the
    table, directory, and manifest, or why it could not be read (``UNREADABLE ...``:
    this user may not; ``CORRUPT ...``: the manifest itself is damaged)."""
    try:
        job_dirs = [p for p in _entries(root) if not p.name.startswith(".")]
    except PermissionError as exc:
        raise PermissionDenied(
            f"cannot read the local tier {root}: {exc.strerror}; run ckptd verify as the "
            "user the daemon runs as (or root), or pass --remote-only to check the bucket"
        ) from None
    found: list[tuple[str, Path, Manifest | None, str]] = []
    for job_dir in job_dirs:
        if job and job_dir.name != job:
            continue
        try:
            step_dirs = [p for p in _entries(job_dir) if p.name.isdigit()]
        except PermissionError as exc:
            found.append((f"local {job_dir.name}", job_dir, None, _unreadable(job_dir, exc)))
            continue
        for step_dir in sorted(step_dirs, key=lambda p: int(p.name)):
            name = f"local {job_dir.name}/{step_dir.name}"
            try:
                raw = (step_dir / MANIFEST).read_text()
            except (FileNotFoundError, NotADirectoryError):
                continue  # never committed (a crash mid-save): not a copy
            except PermissionError as exc:
                found.append((name, step_dir, None, _unreadable(step_dir / MANIFEST, exc)))
                continue
            except OSError as exc:
                found.append((name, step_dir, None, f"CORRUPT {exc}"))
                continue
            try:
                found.append((name, step_dir, Manifest.from_json(raw), ""))
            except ValueError as exc:
                found.append((name, step_dir, None, f"CORRUPT {exc}"))
    return found


def _unreadable(path: Path, exc: OSError) -> str:
    return f"UNREADABLE {path}: {exc.strerror}"


def _verify_local(root: Path, job: str | None) -> list[tuple[str, str]]:
    steps = _local_steps(root, job)
    # An incremental step's check reads its references from their holders' files too.
    total = sum(
        m.size_bytes + sum(int(ref[1]) for r in m.ranks for ref in r.refs or ())
        for _, _, m, _ in steps
        if m is not None
    )
    rows = []
    with ByteProgress(f"verify {root}", total) as progress:
        for name, step_dir, manifest, problem in steps:
            if manifest is None:
                rows.append((name, problem))
                continue
            unreadable: list[str] = []
            holders = holder_dir_on_disk(root, manifest)
            bad = verify_step(step_dir, manifest, progress, unreadable, holders)
            if bad:
                rows.append((name, "CORRUPT " + ", ".join(bad[:3])))
            elif unreadable:
                rows.append((name, "UNREADABLE " + ", ".join(unreadable[:3])))
            else:
                rows.append((name, "OK"))
    return rows


def _verify_hint(cfg: Config, args: argparse.Namespace) -> str:
    """For ``ckptd verify JOB`` finding nothing: the job meant, among those of the
    tiers it looked in ("" when there is none to offer)."""
    if not args.job:
        return ""
    jobs = [] if args.remote_only else local_jobs(cfg.root)
    if cfg.remote and not args.local_only:

        async def listed() -> list[str]:
            remote = open_bucket(cfg)
            try:
                return await bucket_jobs(remote)
            finally:
                await remote.close()

        jobs += asyncio.run(listed())
    return did_you_mean(args.job, jobs, "there")


def cmd_verify(args: argparse.Namespace) -> int:
    """Check crc32c of local copies (re-read) and remote copies (the store's checksums).

    Exit 1 if a copy is corrupt; else 2 (an error line) if one could not be read by
    this user, which is no verdict on the copy; else 0."""
    cfg = load_config(args)
    rows: list[tuple[str, str]] = []
    if not args.remote_only:
        rows += _verify_local(cfg.root, args.job)
    if cfg.remote and not args.local_only:
        rows += asyncio.run(_verify_remote(cfg, args.job))
    if not rows:
        where = ("" if args.remote_only else f"under {cfg.root}") + (
            "" if args.local_only else f" or in {cfg.remote or 'a bucket (none configured)'}"
        )
        what = f"of job {args.job!r} " if args.job else ""
        raise NothingToVerify(
            f"nothing to verify: no checkpoint {what}{where.strip()}; "
            + (
                _verify_hint(cfg, args)
                or "pass --root / --remote (or --config), or run it "
                "where `ckptd serve` runs so its root and bucket are used"
            )
        )
    print_table(
        ["RESULT", "COPY", "DETAIL"],
        [[v.partition(" ")[0], where, v.partition(" ")[2]] for where, v in rows],
    )
    corrupt = sum(1 for _, v in rows if v.startswith("CORRUPT"))
    unreadable = sum(1 for _, v in rows if v.startswith("UNREADABLE"))
    print(
        f"{len(rows)} copies checked, {corrupt} corrupt"
        + (f", {unreadable} unreadable" if unreadable else "")
    )
    if corrupt:
        return 1
    if unreadable:
        raise PermissionDenied(
            f"{unreadable} of {len(rows)} copies could not be read by this user (UNREADABLE "
            "above: not checked, not known to be corrupt); run ckptd verify as the user the "
            "daemon runs as (or root)"
        )
    return 0


def bucket_args(p: argparse.ArgumentParser) -> None:
    """The options of a command that works on the tiers without the daemon."""
    p.add_argument("--config", help="TOML config file (or $CKPTD_CONFIG)")
    p.add_argument(
        "--remote",
        help="bucket URL, s3://BUCKET/PREFIX, gs://... or file://... (default: the "
        "config's, else the running daemon's)",
    )
    p.add_argument("--remote-endpoint-url", dest="remote_endpoint_url", help="endpoint override")
    socket_arg(p)  # the daemon asked for its root and bucket when none is given


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``verify`` on the main parser."""
    p = sub.add_parser("verify", help="check the crc32c of local and remote copies")
    p.add_argument("job", nargs="?", help="only this job")
    p.add_argument(
        "--root", help="local tier directory (default: the config's, else the running daemon's)"
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--local-only", action="store_true", help="only the local tier's copies")
    g.add_argument("--remote-only", action="store_true", help="only the bucket's copies")
    bucket_args(p)
    p.set_defaults(fn=cmd_verify)
