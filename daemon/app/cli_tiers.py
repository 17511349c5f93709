"""``ckptd pull`` and ``ckptd verify``: work on the tiers directly, no daemon needed."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from ckptd.core.checksum import verify_step
from ckptd.core.errors import CkptdError
from ckptd.core.manifest import MANIFEST, Manifest

from ..local.files import write_synced
from ..remote import fetch
from ..remote.backends import open_remote
from ..remote.base import Remote
from ..remote.layout import file_key, manifest_key, parse_marker
from . import config as config_mod
from .config import Config


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, max(total, 1), 0
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()

    def __call__(self, n: int) -> None:
        """Account for ``n`` more bytes."""
        self.done += n
        frac = self.done / self.total
        rate = self.done / max(time.monotonic() - self.start, 1e-6) / 2**20
        bar = "#" * int(30 * frac)
        line = (
            f"{self.label} [{bar:<30}] {self.done / 2**20:8.1f}/{self.total / 2**20:.1f} MiB "
            f"{100 * frac:5.1f}% {rate:7.1f} MiB/s"
        )
        print(
            ("\r" + line) if self.tty else line,
            end="" if self.tty else "\n",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        """End the progress line."""
        if self.tty:
            print(file=sys.stderr)


def load_config(args: argparse.Namespace) -> Config:
    """The daemon's configuration (file, env, flags), as `ckptd serve` would see it."""
    flags = {k: getattr(args, k, None) for k in ("root", "remote", "remote_endpoint_url")}
    return config_mod.load(Path(args.config) if args.config else None, flags=flags)


def _remote(cfg: Config) -> Remote:
    if not cfg.remote:
        raise config_mod.ConfigError(
            "no remote configured: pass --remote s3://BUCKET/PREFIX (or gs://, file://) "
            "or set CKPTD_REMOTE"
        )
    return open_remote(
        cfg.remote, cfg.remote_endpoint_url, cfg.part_size_bytes, cfg.drain_concurrency
    )


async def _pull(cfg: Config, job: str, step: int | None, dest: Path, node: str | None) -> int:
    remote = _remote(cfg)
    try:
        return await _pull_from(remote, cfg, job, step, dest, node)
    finally:
        await remote.close()


async def _pull_from(
    remote: Remote, cfg: Config, job: str, step: int | None, dest: Path, node: str | None
) -> int:
    steps = await fetch.complete_steps(remote, job)
    if not steps:
        raise CkptdError(f"the bucket {cfg.remote} holds no complete step of job {job!r}")
    if step is None:
        step = max(steps)
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
        _, raw, manifest = await fetch.node_manifest(remote, job, step, {n}, None, n, found.adopted)
        target = dest if len(nodes) == 1 else dest / n
        target.mkdir(parents=True, exist_ok=True)
        if any(target.iterdir()):
            raise CkptdError(f"{target} is not empty; pull into a new directory")
        progress = Progress(f"{job}/{step}/{n}", manifest.size_bytes)
        try:
            await fetch.download_files(remote, job, step, n, manifest, target, progress)
            await asyncio.to_thread(write_synced, target / MANIFEST, raw)  # the manifest last
        finally:
            progress.close()
        print(
            f"pulled {job} step {step} ({n}) into {target}: {len(manifest.ranks)} files, "
            f"{manifest.size_bytes} bytes, crc32c verified"
        )
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    """Download a complete step from the bucket into a directory, verified."""
    return asyncio.run(_pull(load_config(args), args.job, args.step, Path(args.dest), args.node))


async def _verify_remote(cfg: Config, job: str | None) -> list[tuple[str, str]]:
    remote = _remote(cfg)
    try:
        return await _verify_remote_in(remote, job)
    finally:
        await remote.close()


async def _verify_remote_in(remote: Remote, job: str | None) -> list[tuple[str, str]]:
    rows = []
    for key in await remote.list_keys(job + "/" if job else ""):
        parsed = parse_marker(key)
        if parsed is None:
            continue
        j, step, node, adopted = parsed
        base = f"{j}/{step}/{node}"
        try:
            key = manifest_key(j, step, node, adopted)
            raw = await remote.get_bytes(key)
            manifest = fetch.parse_remote_manifest(raw, key, j, step, node, adopted)
            bad = [
                r.file
                for r in manifest.ranks
                if await remote.native_crc32c(file_key(j, step, node, r.file, adopted)) != r.crc32c
            ]
        except (OSError, ValueError) as exc:
            bad = [str(exc)]
        rows.append((f"remote {base}", "OK" if not bad else "CORRUPT " + ", ".join(bad)))
    return rows


def cmd_verify(args: argparse.Namespace) -> int:
    """Check crc32c of local copies (re-read) and remote copies (the store's checksums)."""
    cfg = load_config(args)
    rows: list[tuple[str, str]] = []
    if not args.remote_only:
        for job_dir in sorted(p for p in cfg.root.glob("*") if not p.name.startswith(".")):
            if args.job and job_dir.name != args.job:
                continue
            for step_dir in sorted(job_dir.glob("[0-9]*"), key=lambda p: int(p.name)):
                try:
                    manifest = Manifest.from_json((step_dir / "manifest.json").read_text())
                    bad = verify_step(step_dir, manifest)
                except (OSError, ValueError) as exc:
                    bad = [str(exc)]
                rows.append(
                    (
                        f"local {job_dir.name}/{step_dir.name}",
                        "OK" if not bad else "CORRUPT " + ", ".join(bad[:3]),
                    )
                )
    if cfg.remote and not args.local_only:
        rows += asyncio.run(_verify_remote(cfg, args.job))
    for where, verdict in rows:
        print(f"{verdict.split()[0]:8} {where}" + (f"  ({verdict[8:]})" if verdict != "OK" else ""))
    bad_count = sum(1 for _, v in rows if v != "OK")
    print(f"{len(rows)} copies checked, {bad_count} corrupt")
    return 1 if bad_count else 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``pull`` and ``verify`` on the main parser."""

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="TOML config file (or $CKPTD_CONFIG)")
        p.add_argument("--remote", help="remote URL (default: the config's)")
        p.add_argument(
            "--remote-endpoint-url", dest="remote_endpoint_url", help="endpoint override"
        )

    p = sub.add_parser("pull", help="download a complete step from the bucket into a directory")
    p.add_argument("job")
    p.add_argument("dest", help="directory to create (must be empty)")
    p.add_argument("--step", type=int, help="default: the newest complete step")
    p.add_argument("--node", help="only this node's part (default: every node's)")
    common(p)
    p.set_defaults(fn=cmd_pull)
    p = sub.add_parser("verify", help="check the crc32c of local and remote copies")
    p.add_argument("job", nargs="?", help="only this job")
    p.add_argument("--root", help="local tier (default: the config's)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--local-only", action="store_true")
    g.add_argument("--remote-only", action="store_true")
    common(p)
    p.set_defaults(fn=cmd_verify)
