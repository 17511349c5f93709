"""A job's timelines: step numbers order saves within one run, not across runs.

A save whose step number is at or below the newest step of the job's current
timeline (a rerun under a reused job name, or a rollback after restoring an older
step) starts a new timeline, numbered one above the newest known. Its *fork* is
``(timeline, first step)``; every step saved from then on records the job's forks
so far (its lineage), so any surviving step of the newest timeline tells which
older steps were left behind, on any node, after any restart.

A step is *abandoned* when a later timeline forked at or below its number: the
saves above the rollback point that training no longer continues from. The steps
that are not abandoned are the job's *live* history, one line in which a higher
step number is always a later save: restore, retention's "newest" and the drain
read only those. Abandoned steps stay listed (``ckptd ls``) and kept by their
own rule (docs/reliability.md, "Timelines"), and a save under the number of an
abandoned step replaces it.

A save that could not first read what the bucket holds of its job is *blind*: it
always starts a timeline, at its own step, numbered from the clock
(:func:`blind_timeline`), so that whatever the bucket turns out to hold, the
save is the newest of its number and what it follows is decided as a rerun's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .errors import InvalidArgument
from .names import check_step

Forks = tuple[tuple[int, int], ...]
"""``((timeline, first step), ...)``, ascending by timeline; timeline 0 has none."""

MAX_TIMELINE = 1 << 53
"""Timeline numbers read back are below this (a blind save's is a clock reading in
milliseconds: :func:`blind_timeline`)."""
MAX_FORKS = 1 << 20
"""Longest lineage read back."""


def merge(*lineages: Iterable[tuple[int, int]]) -> Forks:
    """The union of several lineages (one fork per timeline; on a disagreement, which
    only a bug could cause, the lower first step wins: it abandons more)."""
    out: dict[int, int] = {}
    for lineage in lineages:
        for timeline, start in lineage:
            if timeline not in out or start < out[timeline]:
                out[timeline] = start
    return tuple(sorted(out.items()))


def abandoned(timeline: int, step: int, forks: Mapping[int, int] | Forks) -> bool:
    """Whether a step of ``timeline`` numbered ``step`` was left behind by a later
    timeline of ``forks`` (one that began at or below ``step``)."""
    items = forks.items() if isinstance(forks, Mapping) else forks
    return any(t > timeline and start <= step for t, start in items)


def replaced(timeline: int, step: int, forks: Mapping[int, int] | Forks) -> bool:
    """Whether the save of ``timeline`` numbered ``step`` was replaced: a later timeline
    of ``forks`` began with a save under that very number (a save under a held number
    replaces it; abandoned steps above the fork are not replaced, only left behind)."""
    items = forks.items() if isinstance(forks, Mapping) else forks
    return any(t > timeline and start == step for t, start in items)


def timeline_at(step: int, timeline: int, forks: Mapping[int, int] | Forks) -> int:
    """The timeline of the save numbered ``step`` in the history a save on ``timeline``
    (with lineage ``forks``) grew from: the newest timeline up to ``timeline`` that
    began at or below ``step``, 0 if none did. How a step's references name their
    holders: by number, on the referrer's own history (a later timeline may have
    saved another step under the same number since)."""
    items = forks.items() if isinstance(forks, Mapping) else forks
    return max((t for t, start in items if t <= timeline and start <= step), default=0)


def newest(forks: Forks, timelines: Iterable[int] = ()) -> int:
    """The highest timeline known (0 for a job that never forked)."""
    return max([0, *(t for t, _ in forks), *timelines])


def blind_timeline(current: int, now_unix: float) -> int:
    """The timeline of a save that could not first read what the bucket holds of its
    job (a node that lost its disk, saving during an outage): the bucket may hold
    timelines above ``current`` (the newest this node knows) that it cannot see, so
    the save starts a timeline numbered from the clock, in milliseconds, above any
    the bucket can hold: each of those was numbered one above a known timeline, or
    from an earlier clock reading, and no job forks once per millisecond."""
    return min(max(current + 1, int(now_unix * 1000)), MAX_TIMELINE - 1)


def check_forks(raw: Any, where: str = "forks") -> Forks:
    """A lineage read from a manifest, a marker or the journal, checked: a list of
    ``[timeline, first step]`` pairs of non-negative ints, timelines >= 1, each once."""
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple) or len(raw) > MAX_FORKS:
        raise InvalidArgument(f"{where} is not a list of [timeline, first step] pairs")
    seen: set[int] = set()
    out = []
    for pair in raw:
        if (
            not isinstance(pair, list | tuple)
            or len(pair) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
        ):
            raise InvalidArgument(f"{where} holds {str(pair)[:40]!r}, not [timeline, first step]")
        timeline, start = int(pair[0]), int(pair[1])
        if not 1 <= timeline < MAX_TIMELINE or timeline in seen:
            raise InvalidArgument(f"{where}: timeline {timeline} is out of range or repeated")
        check_step(start)
        seen.add(timeline)
        out.append((timeline, start))
    return tuple(sorted(out))


def check_timeline(raw: Any, forks: Forks, where: str = "timeline") -> int:
    """A step's timeline, checked against its lineage (a timeline >= 1 has a fork)."""
    if not isinstance(raw, int) or isinstance(raw, bool) or not 0 <= raw < MAX_TIMELINE:
        raise InvalidArgument(f"{where} = {str(raw)[:40]!r} is not a timeline number")
    if raw and raw not in dict(forks):
        raise InvalidArgument(f"{where} {raw} has no fork in the step's lineage")
    return int(raw)
