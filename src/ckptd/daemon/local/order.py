"""A job's saves in order: acknowledged in order, written one step at a time, the
newest first when saves arrive faster than the disk writes them.

A save is acknowledged once its handoff is journaled (saver.py): from then on it
survives the trainer and a daemon crash in shared memory, and it reaches LOCAL
in the order the job's saves were acknowledged. A job's steps are written one at
a time (the ranks of one step together): two steps written side by side share
the disk and both arrive late, and the older one's place could not be given up.

While a step waits for its turn, a newer save of the job whose every rank's
bytes are in (the trainer's copy done, its handoff journaled) takes its place:
the waiting step is never written, and ends SUPERSEDED (``supersede_unwritten``),
if its client asked for it (``Client(supersede=True)``, or a policy that saves every
step; never a framework integration, which names each checkpoint it saved).
So a trainer that saves every step never waits for the disk while the staging
budget has room for the step being written, the newest acknowledged one and the
one it is copying: the disk writes the newest save it can, the others' memory
goes back at once. A milestone is always written, and so is a save that
replaces a step under the same number or starts a new timeline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from ckptd.proto import ckptd_pb2 as pb

from .. import faults
from .pending import PendingStep

SUPERSEDED_REASON = (
    "step {newer} of the job was acknowledged before this save's write began; the "
    "local disk writes the newest save it can (supersede_unwritten)"
)


class Superseded(Exception):
    """The step's write will not begin: a newer save of the job took its place (or
    the step ended otherwise meanwhile)."""


def _older(pendings: Iterable[PendingStep], me: PendingStep) -> list[PendingStep]:
    """The job's saves acknowledged before ``me``, every rank handed off, not LOCAL yet.
    A save still waiting for ranks that never hand off is not counted: it may wait
    ``step_timeout_seconds``, and it fails alone."""
    return [
        other
        for other in list(pendings)
        if other is not me
        and other.step.job == me.step.job
        and other.ticket < me.ticket
        and other.step.state == pb.SAVE_STATE_STAGING
        and other.handed_off()
    ]


async def after_older(pendings: Iterable[PendingStep], me: PendingStep) -> None:
    """Wait until every older save of the job that was fully handed off is LOCAL or
    ended, so a job's steps reach LOCAL in the order their saves were acknowledged
    (a reader of "the newest LOCAL step" would otherwise skip an acknowledged older
    one still in flight, and a crash in between would leave a gap)."""
    for other in _older(pendings, me):
        await other.settled.wait()


async def turn(pendings: Iterable[PendingStep], me: PendingStep) -> None:
    """Wait until no older save of the job is being written or waits for its turn;
    then ``me``'s write may begin (it can no longer be superseded). Raises
    :class:`Superseded` if a newer save took its place meanwhile (or ``me`` ended
    otherwise: failed, its other ranks never handed off)."""
    while not me.superseded and not me.settled.is_set():
        older = [o for o in _older(pendings, me) if not o.settled.is_set()]
        if not older:
            me.started = True
            return
        waits = [asyncio.ensure_future(e.wait()) for e in (o.settled for o in older)]
        waits.append(asyncio.ensure_future(me.settled.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
    raise Superseded(me.step.error or "a newer save of the job took its place")


def supersede_older(pendings: Iterable[PendingStep], newer: PendingStep) -> list[PendingStep]:
    """The older saves of ``newer``'s job that ``newer`` takes the place of, marked so
    they never begin their write (the caller ends them). Call once ``newer``'s every
    rank has handed off and its bytes are in."""
    me = newer.step
    gone = [
        other
        for other in _older(pendings, newer)
        if not other.started
        and not other.superseded
        and other.supersedable
        and not other.step.milestone
        and other.replaces is None
        and other.step.timeline == me.timeline
        and other.step.step < me.step
    ]
    for other in gone:
        other.superseded = True
    return gone


async def newest_written(pendings: Iterable[PendingStep], job: str) -> None:
    """Wait until the job's newest save in flight (every rank handed off) is LOCAL or
    ended: a restore of "the newest step" then finds what was acknowledged last."""
    for _ in range(3):  # a live trainer's next saves are not chased for long
        live = [
            p
            for p in list(pendings)
            if p.step.job == job and p.step.state == pb.SAVE_STATE_STAGING and p.handed_off()
        ]
        if not live:
            return
        newest = max(live, key=lambda p: p.ticket)
        if faults.armed("restore.in_flight"):  # a test learns the restore waits here
            await asyncio.to_thread(faults.hit, "restore.in_flight")
        await newest.settled.wait()
        if not newest.superseded:
            return
