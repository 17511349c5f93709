"""Retention with references: a tier that holds a step holds the steps it references.

An incremental step's rank files hold only what changed; its other bytes are
ranges of older steps' rank files, its *holders* (core/increments.py), and a
holder may have holders of its own. Every tier that holds a complete copy of a
step holds its holders, transitively, so the rules here run after the policies
and the safety rules (plan.py) and only ever keep more:

- a local copy that a kept local copy, or a step in use, references is kept
  (``referenced-by-step-N``), and evicted at the first plan that no longer
  needs it;
- a bucket copy that a kept bucket copy, a step in use or a step waiting to go
  up references is kept likewise;
- a pending step that a step which may still go up references is wanted by the
  bucket (it goes up first, lifecycle/drain.py), never SUPERSEDED.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Set

HoldersOf = Callable[[int], Set[int]]
"""A step's holders (the steps its references read), from its manifest."""


def referenced(seeds: Iterable[int], holders_of: HoldersOf) -> dict[int, int]:
    """Every step the ``seeds`` need, transitively (holders' holders too), each with
    the newest step that references it directly (the reason shown for keeping it).
    A seed appears only if another needed step references it."""
    by: dict[int, int] = {}
    todo = list(seeds)
    seen = set(todo)
    while todo:
        step = todo.pop()
        for holder in holders_of(step):
            if holder >= step:  # a manifest check refuses these; never loop on one
                continue
            if by.get(holder, -1) < step:
                by[holder] = step
            if holder not in seen:
                seen.add(holder)
                todo.append(holder)
    return by


def reason(referrer: int) -> str:
    """The reason a step stays in a tier for a step that references it."""
    return f"referenced-by-step-{referrer}"


def keep_referenced(
    evict: list[int],
    reasons: dict[int, list[str]],
    held: Set[int],
    seeds: Iterable[int],
    holders_of: HoldersOf,
) -> set[int]:
    """In one tier (``held``: the steps it holds): take out of ``evict`` every step the
    ``seeds`` need, and add the reason to each needed step's reasons. Returns the
    needed steps the tier holds."""
    needed = {s: by for s, by in referenced(seeds, holders_of).items() if s in held}
    if not needed:
        return set()
    evict[:] = [s for s in evict if s not in needed]
    for step, by in needed.items():
        why = reasons.setdefault(step, [])
        if reason(by) not in why:
            why.append(reason(by))
    return set(needed)


def holders_lookup(holders: Mapping[int, Set[int]]) -> HoldersOf:
    """:data:`HoldersOf` over a step -> holders map (unknown steps have none)."""
    empty: frozenset[int] = frozenset()
    return lambda step: holders.get(step, empty)
