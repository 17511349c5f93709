"""``ckptd own JOB USER``: give a job that has no owner to a user (an operator's command).

A root written before ckptd recorded job owners keeps the jobs whose files do not
tell their user closed to everyone but operators (api/owners.py); this assigns
one. It writes ``<root>/.owners/<job>``; a running daemon reads it at the job's
next use, so no restart is needed.
"""

from __future__ import annotations

import argparse
import pwd
from pathlib import Path

from ckptd.core.errors import InvalidArgument

from ..api.owners import UNASSIGNED, assign
from .cli_tiers import load_config
from .cli_view import socket_arg


def uid_of(user: str) -> int:
    """A uid given as a number or a user name."""
    if user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise InvalidArgument(f"no user named {user!r} on this machine; give a uid") from None


def cmd_own(args: argparse.Namespace) -> int:
    """Assign ``args.job`` to ``args.user`` under the daemon's root."""
    uid = uid_of(args.user)
    root = load_config(args).root
    try:
        before = assign(root, args.job, uid)
    except PermissionError:
        raise InvalidArgument(
            f"cannot write under {root}: run `ckptd own` as root or as the daemon's user"
        ) from None
    was = "was closed (no owner could be told)" if before == UNASSIGNED else "had no owner"
    print(f"job {args.job!r} {was}; it belongs to uid {uid} now ({Path(root)})")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``own`` on the main parser."""
    p = sub.add_parser("own", help="give a job that has no owner to a user (operators)")
    p.add_argument("job", help="the job to assign (one with no recorded owner)")
    p.add_argument("user", help="user name or uid")
    p.add_argument("--root", help="the daemon's root (default: the config's, else the daemon's)")
    p.add_argument("--config", help="TOML config file (or $CKPTD_CONFIG)")
    socket_arg(p)
    p.set_defaults(fn=cmd_own)
