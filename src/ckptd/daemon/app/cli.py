"""The ``ckptd`` command: serve, ls, events, pin, unpin, adopt, demo (status: cli_status;
pull, verify: cli_tiers; own: cli_own; tables and progress bars: cli_view).

Errors print one line (``ckptd: error: ...``) and exit non-zero; no tracebacks.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ckptd.core.errors import CkptdError, cli_line
from ckptd.core.health import NONFINITE_METRIC
from ckptd.core.wire import Connection
from ckptd.proto import ckptd_pb2 as pb

from .. import __version__
from . import cli_own, cli_status, cli_tiers, logs
from . import config as config_mod
from .cli_status import plain
from .cli_view import human_bytes, print_table, socket_arg
from .serve import serve


def _admin(args: argparse.Namespace) -> Connection:
    return Connection(args.socket, timeout=30.0)


def cmd_serve(args: argparse.Namespace) -> int:
    flags = {k: getattr(args, k) for k in config_mod.flag_names()}
    cfg = config_mod.load(Path(args.config) if args.config else None, flags=flags)
    logs.setup(cfg.log_level)  # third-party request logging capped, credentials masked
    for warning in config_mod.unknown_env():
        logging.getLogger("ckptd.server").warning("%s", warning)
    import uvloop

    uvloop.run(serve(cfg))
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    resp = _admin(args).list_checkpoints(pb.ListCheckpointsRequest(job=args.job or ""))
    if args.json:
        print(json.dumps([plain(c) for c in resp.checkpoints], indent=1))
        return 0
    rows = [
        [
            c.job,
            str(c.step),
            pb.SaveState.Name(c.state).removeprefix("SAVE_STATE_"),
            ",".join(pb.Tier.Name(t).removeprefix("TIER_").lower() for t in c.tiers) or "-",
            human_bytes(c.size_bytes) if c.size_bytes else "-",
            str(c.num_shards),
            # 0: a bucket copy whose marker was listed, not read: unknown, not 1970.
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.created_unix))
            if c.created_unix
            else "-",
            _kept_by(c),
            (f"abandoned (timeline {c.timeline}) " if c.abandoned else "")
            + (f"timeline {c.timeline} " if c.timeline and not c.abandoned else "")
            + ("milestone " if c.milestone else "")
            + ("pinned " if c.pinned else "")
            + ("adopted " if c.adopted else "")
            + _unhealthy(c)
            + (c.error[:60] if c.error else ""),
        ]
        for c in resp.checkpoints
    ]
    if not rows:
        print("no checkpoints" + (f" for job {args.job!r}" if args.job else ""))
        if args.job:
            _suggest_job(args, args.job)
        return 0
    headers = ["JOB", "STEP", "STATE", "TIERS", "SIZE", "SHARDS", "CREATED", "KEPT BY", "NOTE"]
    print_table(headers, rows)
    return 0


def _suggest_job(args: argparse.Namespace, job: str) -> None:
    """On stderr: the job name this one is probably a typo of, or the jobs there are."""
    every = _admin(args).list_checkpoints(pb.ListCheckpointsRequest(job=""))
    jobs = sorted({c.job for c in every.checkpoints})
    close = difflib.get_close_matches(job, jobs, n=1, cutoff=0.6)
    if close:
        print(f"did you mean {close[0]!r}?", file=sys.stderr)
    elif jobs:
        print(f"jobs on this daemon: {', '.join(jobs[:20])}", file=sys.stderr)


def _unhealthy(c: pb.CheckpointInfo) -> str:
    """``nan/inf=N `` for a step holding NaN/Inf values (healthy and uncounted: "")."""
    n = c.metrics.get(NONFINITE_METRIC, 0.0)
    return f"nan/inf={int(n)} " if n else ""


def _kept_by(c: pb.CheckpointInfo) -> str:
    """``local=latest remote=latest,every-10-steps``: why each tier holds the step."""
    parts = [
        f"{tier}={','.join(reasons)}"
        for tier, reasons in (("local", c.local_reasons), ("remote", c.remote_reasons))
        if reasons
    ]
    return " ".join(parts) or "-"


def cmd_pin(args: argparse.Namespace) -> int:
    pinned = args.command == "pin"
    req = pb.PinRequest(job=args.job, step=args.step, pinned=pinned)
    _admin(args).pin(req, 60.0)
    what = "pinned: no tier evicts it" if pinned else "unpinned: retention applies again"
    print(f"{args.job}/{args.step} {what}")
    return 0


def cmd_prefetch(args: argparse.Namespace) -> int:
    resp = _admin(args).prefetch(pb.PrefetchRequest(job=args.job), 3600.0)
    where = {"peer": "taken from a peer", "remote": "fetched from the bucket"}
    print(
        f"{args.job}/{resp.step}: local ({where.get(resp.source, 'it was already')}, "
        f"{human_bytes(resp.size_bytes)}); restore() reads it from this node's disk"
    )
    return 0


def cmd_adopt(args: argparse.Namespace) -> int:
    conn = _admin(args)
    path = os.path.abspath(args.path)
    req = pb.AdoptRequest(job=args.job, step=args.step, path=path, milestone=args.milestone)
    resp = conn.adopt(req, 3600.0)
    print(
        f"{args.job}/{args.step} adopted from {path}: {resp.files} files, "
        f"{human_bytes(resp.size_bytes)}, LOCAL"
    )
    if args.wait == "durable":
        status = conn.get_save_status(
            pb.GetSaveStatusRequest(
                job=args.job,
                step=args.step,
                wait_for=pb.SAVE_STATE_DURABLE,
                timeout_seconds=args.timeout,
            ),
            args.timeout + 30.0,
        )
        if not status.reached:
            state = pb.SaveState.Name(status.state).removeprefix("SAVE_STATE_")
            print(f"ckptd: error: not DURABLE ({state}): {status.error}", file=sys.stderr)
            return 1
        print(f"{args.job}/{args.step} DURABLE")
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    conn = _admin(args)
    after = 0
    while True:
        req = pb.ListEventsRequest(
            job=args.job or "", after_seq=after, wait_seconds=25.0 if args.follow else 0.0
        )
        resp = conn.list_events(req, 60.0)
        for e in resp.events:
            if args.json:
                print(json.dumps(plain(e)), flush=args.follow)
                continue
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time_unix))
            kind = pb.StepEvent.Name(e.kind).removeprefix("STEP_EVENT_")
            state = pb.SaveState.Name(e.state).removeprefix("SAVE_STATE_")
            attrs = " ".join(f"{k}={v}" for k, v in sorted(e.attributes.items()))
            note = " ".join(x for x in (attrs, e.detail) if x)
            print(
                f"{when} #{e.seq} {e.job}/{e.step} {kind} -> {state} {note}".rstrip(),
                flush=args.follow,
            )
            after = e.seq
        after = max(after, resp.events[-1].seq if resp.events else after)
        if not args.follow:
            return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(steps=args.steps, save_every=args.save_every, keep=args.keep)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used to generate the README's CLI reference)."""
    parser = argparse.ArgumentParser(
        prog="ckptd", description="Per-node checkpoint daemon for ML training."
    )
    parser.add_argument("--version", action="version", version=f"ckptd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the daemon")
    p.add_argument("--config", help="TOML config file (or $CKPTD_CONFIG)")
    docs, defaults = config_mod.field_docs(), config_mod.default_values()
    for key in config_mod.flag_names():
        p.add_argument(
            f"--{key.replace('_', '-')}",
            dest=key,
            default=None,
            metavar="VALUE",
            # argparse formats help with %: a literal one ("10%") is doubled.
            help=(
                f"{docs.get(key, '')} Default: {defaults[key] or '(none)'}. "
                f"Config key {key}, env CKPTD_{key.upper()}."
            ).replace("%", "%%"),
        )
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("ls", help="list checkpoints and their states")
    p.add_argument("job", nargs="?", help="only this job")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    socket_arg(p)
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser("events", help="step transitions the daemon recorded (newest last)")
    p.add_argument("job", nargs="?", help="only this job")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    socket_arg(p)
    p.set_defaults(fn=cmd_events)
    cli_status.add_parser(sub)
    for name, text in (
        ("pin", "keep a step in every tier whatever the retention"),
        ("unpin", "let the retention policies decide about a step again"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("job", help="the training job's name")
        p.add_argument("step", type=int, help="the step number")
        socket_arg(p)
        p.set_defaults(fn=cmd_pin)
    p = sub.add_parser(
        "prefetch", help="make the job's newest step local before the trainer restores it"
    )
    p.add_argument("job", help="the training job's name")
    socket_arg(p)
    p.set_defaults(fn=cmd_prefetch)
    p = sub.add_parser(
        "adopt", help="hand a finished checkpoint directory (DCP, Orbax, HF...) to the daemon"
    )
    p.add_argument("job", help="the training job's name")
    p.add_argument("step", type=int, help="the step number the directory holds")
    p.add_argument("path", help="the finished directory (not modified afterwards)")
    p.add_argument("--milestone", action="store_true", help="keep it as a milestone")
    p.add_argument(
        "--wait",
        choices=["local", "durable"],
        default="local",
        help="return once the step is LOCAL (default) or DURABLE in the bucket",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for DURABLE")
    socket_arg(p)
    p.set_defaults(fn=cmd_adopt)
    cli_tiers.add_parsers(sub)
    cli_own.add_parser(sub)
    p = sub.add_parser("demo", help="start a daemon, train, kill the trainer, resume")
    p.add_argument("--steps", type=int, default=40, help="training steps (default: 40)")
    p.add_argument("--save-every", type=int, default=5, help="save every N steps (default: 5)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.set_defaults(fn=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckptd`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except CkptdError as exc:  # the one family every user-facing error belongs to
        print(cli_line(exc), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `ckptd ls | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
