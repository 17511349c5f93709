"""The catalog's timeline arithmetic (core/timeline.py), as pure functions over steps.

The catalog calls these when steps come and go; nothing here changes a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ckptd.core.timeline import Forks, abandoned, blind_timeline, merge, newest

from .step import DRAINING, DURABLE, LOCAL, SUPERSEDED, Step


def outdated(st: Step, ours: bool, timeline: int | None) -> bool:
    """Whether a copy in the bucket of ``timeline`` (``ours``: this node's own) is of a
    later save under ``st``'s number than ``st`` is: a local copy taken back after a
    node loss (from a peer the later save never reached) that the later save replaced.
    Not a step being saved, nor a pinned one; one being uploaded is (its upload would
    retract the later save's copy as the one it replaced: the drain stops it)."""
    later = ours and timeline is not None and timeline > st.timeline
    return later and st.state in (LOCAL, DRAINING, DURABLE, SUPERSEDED) and not st.pinned


def lineage(steps: Iterable[Step]) -> Forks:
    """The forks of a job's steps that count (a save that failed with nothing kept
    does not: a fork whose only save failed is forgotten)."""
    return merge(*(s.forks for s in steps if s.in_lineage))


def flips(steps: Iterable[Step], forks: Forks) -> list[tuple[Step, bool]]:
    """The steps whose abandoned flag differs from what ``forks`` says, with the new flag."""
    out = []
    for s in steps:
        gone = abandoned(s.timeline, s.step, forks)
        if gone != s.abandoned:
            out.append((s, gone))
    return out


def current(steps: Sequence[Step], forks: Forks) -> int:
    """The newest timeline of a job's ``steps`` that count, or of its ``forks``."""
    return newest(forks, (s.timeline for s in steps if s.in_lineage))


def next_timeline(
    steps: Sequence[Step],
    forks: Forks,
    step: int,
    now_unix: float = 0.0,
    blind: int | None = None,
) -> tuple[int, Forks]:
    """``(timeline, forks)`` of a new save of ``step`` among a job's ``steps``: the
    current timeline, or a new one when ``step`` is at or below the newest step of the
    live history. ``blind``: the job's saves could not read what the bucket holds of
    it (the timeline its first blind save began, 0: none yet): a new timeline from the
    clock, whatever this node knows, unless one begun so is still in the lineage (a
    blind save that failed with nothing kept took its fork along)."""
    counted = [s for s in steps if s.in_lineage]
    now = current(counted, forks)
    if blind is not None and not 0 < blind <= now:
        number = blind_timeline(now, now_unix)
        return number, merge(forks, [(number, step)])
    top = max((s.step for s in counted if not s.abandoned), default=None)
    if top is not None and step <= top:
        return now + 1, merge(forks, [(now + 1, step)])
    return now, forks


def left_behind(steps: Iterable[Step], at: int) -> tuple[list[int], str]:
    """The abandoned steps at or above ``at`` (those a fork there left), and in words."""
    newer = sorted(s.step for s in steps if s.abandoned and s.step >= at)
    span = f"{newer[0]}..{newer[-1]}" if len(newer) > 1 else ", ".join(map(str, newer))
    return newer, span
