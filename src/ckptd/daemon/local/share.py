"""Shares of the staging budget among uids, and capacity errors that stay private.

A live client keeps its leases however long it takes (staging.py), so without a
rule one user could hold the whole budget and every other user's saves would
wait or fail. Two rules bound what one uid's leases hold:

- ``staging_share_per_uid`` (a fraction of ``staging_budget_bytes``; 1 by
  default, no cap of its own): a uid never holds more than that share.
- Whatever the share, while another uid saves on the node (a process of it that
  asked for a save lease still lives) or waits for staging memory, a uid that
  already holds leases gets no new one that would take it past its fair part:
  the budget split evenly among the uids saving, holding or waiting. A uid
  holding nothing is never held back by this rule (so a save larger than the
  fair part still goes, and nobody waits forever), and with one user on the
  node it never applies: that user may use the whole budget.

Leases are never taken back from a live client, so memory a uid took while it
was alone stays its own until those saves end (at LOCAL); from then on it gets
only its fair part. A node shared with users who may hold leases on purpose
sets ``staging_share_per_uid`` too.

A lease counts for the uid its segment was granted to (``Segment.uid``). Errors
name only the asking uid's own jobs; memory other users hold is given as a
total, never with their job names.
"""

from __future__ import annotations

from collections.abc import Iterable

from .lease import Lease

__all__ = ["held_by_uid", "holders_text", "over_share"]


def held_by_uid(leases: Iterable[Lease]) -> dict[int | None, int]:
    """Bytes of leased segments per uid."""
    held: dict[int | None, int] = {}
    for lease in leases:
        held[lease.segment.uid] = held.get(lease.segment.uid, 0) + lease.segment.size
    return held


def over_share(
    uid: int | None,
    need: int,
    held: dict[int | None, int],
    others: Iterable[int | None],
    budget_bytes: int,
    share: float,
) -> str:
    """Why ``uid`` may not take ``need`` more bytes now ("" if it may). ``others``:
    the uids saving on the node or waiting for staging memory (``uid`` may be
    among them)."""
    mine = held.get(uid, 0)
    cap = int(budget_bytes * share)
    if share < 1 and mine + need > cap:
        return (
            f"this user's leases hold {mine} bytes and one user may hold at most {cap} "
            f"(staging_share_per_uid {share:g} of staging_budget_bytes {budget_bytes})"
        )
    rivals = {u for u in others if u != uid}
    if rivals and mine:
        users = len(rivals | {u for u, n in held.items() if n} | {uid})
        fair = budget_bytes // users
        if mine + need > fair:
            return (
                f"this user's leases hold {mine} bytes and {len(rivals)} other user(s) save "
                f"on this node or wait for staging memory; while they do, each of the {users} "
                f"users gets {fair} bytes"
            )
    return ""


def holders_text(leases: Iterable[Lease], uid: int | None, now: float) -> str:
    """What holds leased memory, in words, as ``uid`` may see it: its own leases by
    kind with their jobs, other users' only as a total."""
    kinds: dict[str, list[Lease]] = {}
    others = 0
    for lease in leases:
        if lease.segment.uid != uid:
            others += lease.segment.size
            continue
        if lease.committed:
            kind = "handed-off saves being written to disk"
        elif lease.restore:
            kind = "restores not yet mapped by their client"
        else:
            kind = "leases granted to clients that have not committed yet"
        kinds.setdefault(kind, []).append(lease)
    parts = []
    for kind, mine in kinds.items():
        jobs = sorted({lease.job for lease in mine})
        oldest = max(now - lease.granted_at for lease in mine)
        parts.append(
            f"{sum(lease.segment.size for lease in mine)} bytes in {len(mine)} of your {kind} "
            f"(jobs {', '.join(jobs[:4])}{'...' if len(jobs) > 4 else ''}; "
            f"oldest {oldest:.0f} s)"
        )
    if others:
        parts.append(
            f"{others} bytes by other users' saves and restores (an operator can bound "
            "what one user holds with staging_share_per_uid)"
        )
    return "; ".join(parts) or "nothing (free segments too small to reuse)"
