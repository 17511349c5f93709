"""The ``ckptd`` command: serve, ls, events, pin, unpin, adopt, demo (status: cli_status;
pull, verify: cli_tiers; own: cli_own; tables and progress bars: cli_view).

Errors print one line (``ckptd: error: ...``) and exit non-zero; no tracebacks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ckptd.core.errors import CkptdError, NotFound, cli_line
from ckptd.core.health import NONFINITE_METRIC
from ckptd.core.wire import Connection
from ckptd.proto import ckptd_pb2 as pb

from .. import __version__
from . import cli_own, cli_pull, cli_status, cli_tiers, logs
from . import config as config_mod
from .cli_completion import add_completion_parser
from .cli_help import add_config_options, name_placeholders
from .cli_jobs import did_you_mean, with_hint
from .cli_status import plain
from .cli_view import human_bytes, print_table, socket_arg
from .serve import serve


def _admin(args: argparse.Namespace) -> Connection:
    return Connection(args.socket, timeout=30.0)


def cmd_serve(args: argparse.Namespace) -> int:
    flags = {k: getattr(args, k) for k in config_mod.flag_names()}
    config_mod.refuse_unknown_env()
    overrides: list[str] = []
    cfg = config_mod.load(
        Path(args.config) if args.config else None, flags=flags, overrides=overrides
    )
    logs.setup(cfg.log_level)  # third-party request logging capped, credentials masked
    for line in overrides:
        logging.getLogger("ckptd.server").warning("%s", line)
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
    hint = _job_hint(args, job)
    if hint:
        print(hint, file=sys.stderr)


def _job_hint(args: argparse.Namespace, job: str) -> str:
    """:func:`cli_jobs.did_you_mean` over the daemon's jobs; "" if the daemon cannot
    tell (a hint must never replace the error it decorates)."""
    try:
        jobs = _daemon_jobs(args)
    except CkptdError:
        return ""
    return did_you_mean(job, jobs, "on this daemon")


def _daemon_jobs(args: argparse.Namespace) -> set[str]:
    every = _admin(args).list_checkpoints(pb.ListCheckpointsRequest(job=""))
    return {c.job for c in every.checkpoints}


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
        if args.job and not after and not resp.events:  # nothing ever happened to it
            print(f"no events for job {args.job!r}", file=sys.stderr)
            _suggest_job(args, args.job)
        for e in resp.events:
            if args.json:
                print(json.dumps(plain(e)), flush=args.follow)
                continue
            print(event_line(e), flush=args.follow)
            after = e.seq
        after = max(after, resp.events[-1].seq if resp.events else after)
        if not args.follow:
            return 0


def event_line(e: pb.EventRecord) -> str:
    """``2026-01-02 03:04:05 #7 job/20 EVICTED_LOCAL -> DURABLE (remote) retention``:
    the event, the step's state after it and the tiers holding it; a step the event
    took out of the catalog (no copy left) says so rather than naming a state."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time_unix))
    kind = pb.StepEvent.Name(e.kind).removeprefix("STEP_EVENT_")
    if e.state == pb.SAVE_STATE_UNSPECIFIED:
        after = "(no copy left on this node or in its bucket)"
    else:
        tiers = ",".join(pb.Tier.Name(t).removeprefix("TIER_").lower() for t in e.tiers)
        after = f"-> {pb.SaveState.Name(e.state).removeprefix('SAVE_STATE_')}"
        after += f" ({tiers})" if tiers else ""
    attrs = " ".join(f"{k}={v}" for k, v in sorted(e.attributes.items()))
    note = " ".join(x for x in (attrs, e.detail) if x)
    return f"{when} #{e.seq} {e.job}/{e.step} {kind} {after} {note}".rstrip()


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(steps=args.steps, save_every=args.save_every, keep=args.keep)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used to generate the README's CLI reference)."""
    parser = argparse.ArgumentParser(
        prog="ckptd", description="Per-node checkpoint daemon for ML training."
    )
    parser.add_argument("--version", action="version", version=f"ckptd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "serve",
        help="run the daemon",
        description="Run the daemon. Every option is also a config file key and a CKPTD_<KEY> "
        "environment variable; flags beat the environment, which beats the file.",
    )
    add_config_options(p)
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
    cli_pull.add_parser(sub)
    cli_tiers.add_parser(sub)
    cli_own.add_parser(sub)
    p = sub.add_parser("demo", help="start a daemon, train, kill the trainer, resume")
    p.add_argument("--steps", type=int, default=40, help="training steps (default: 40)")
    p.add_argument("--save-every", type=int, default=5, help="save every N steps (default: 5)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.set_defaults(fn=cmd_demo)
    add_completion_parser(parser, sub)
    name_placeholders(parser)
    return parser


_NAMES_A_DAEMON_JOB = (cmd_pin, cmd_prefetch)
"""Commands whose NOT_FOUND may come from a mistyped job (``pin``, ``unpin``, ``prefetch``)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckptd`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except CkptdError as exc:  # the one family every user-facing error belongs to
        line = cli_line(exc)
        if isinstance(exc, NotFound) and args.fn in _NAMES_A_DAEMON_JOB:
            line = with_hint(line, _job_hint(args, args.job))
        print(line, file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `ckptd ls | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
