""" "Did you mean": the job a mistyped name probably meant, for every command naming one.

One wording for all of them (``ls``, ``events``, ``pin``, ``unpin``, ``prefetch``,
``pull``, ``verify``): the closest known job, else the jobs there are, so a typo
is caught at the first try whichever command it was made in.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

from ..remote.base import Remote

SHOWN = 20
"""Most job names listed when none is close to the one given."""


def did_you_mean(job: str, jobs: Iterable[str], where: str) -> str:
    """``did you mean 'train-a'?``, or ``jobs <where>: a, b`` when none is close; ""
    when there is no other job to offer."""
    names = sorted(set(jobs) - {job})
    close = difflib.get_close_matches(job, names, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    if not names:
        return ""
    more = f" (and {len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return f"jobs {where}: {', '.join(names[:SHOWN])}{more}"


def with_hint(message: str, hint: str) -> str:
    """``message; hint`` (the message alone when there is no hint)."""
    return f"{message}; {hint}" if hint else message


def local_jobs(root: Path) -> list[str]:
    """The job directories under a local tier's root (hidden ones are ckptd's own)."""
    try:
        return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:  # missing or unreadable: nothing to offer, the caller's error stands
        return []


async def bucket_jobs(remote: Remote) -> list[str]:
    """The jobs in a bucket: its top-level names but ckptd's own (``_nodes``)."""
    try:
        names = await remote.list_dirs("")
    except Exception:  # a hint must never replace the error it decorates
        return []
    return [n for n in names if n and not n.startswith(("_", "."))]
