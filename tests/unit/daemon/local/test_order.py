"""Which of a job's saves a newer one takes the place of, and the turn of a step's
write (daemon/local/order.py), on pending steps built in memory."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ckptd.daemon.catalog import Step
from ckptd.daemon.local import order
from ckptd.daemon.local.pending import PendingStep
from ckptd.proto import ckptd_pb2 as pb


def pending(step: int, ticket: int, job: str = "j", **values: Any) -> PendingStep:
    """A step of ``job`` whose every rank (0 and 1) has handed off."""
    st = Step(job, step, state=pb.SAVE_STATE_STAGING, node_ranks=(0, 1), **values)
    p = PendingStep(st, commit=None, ticket=ticket)  # type: ignore[arg-type]
    p.writing.update({0, 1})
    return p


def test_a_newer_save_takes_the_place_of_older_ones_not_begun() -> None:
    writing, waiting, also = pending(1, 1), pending(2, 2), pending(3, 3)
    writing.started = True
    newest = pending(4, 4)
    gone = order.supersede_older([writing, waiting, also, newest], newest)
    assert gone == [waiting, also] and waiting.superseded and also.superseded
    assert not writing.superseded and not newest.superseded
    # Marked once: a later save does not end them again.
    assert order.supersede_older([writing, waiting, also, newest, pending(5, 5)], newest) == []


@pytest.mark.parametrize(
    "older",
    [
        pending(2, 2, milestone=True),  # a milestone is always written
        pending(2, 2, job="other"),  # another job's saves are its own
        pending(2, 2, timeline=7),  # another timeline
        pending(9, 2),  # a higher number, saved before: a rollback's older save
        pending(2, 9),  # acknowledged after the newer one
    ],
)
def test_saves_that_are_always_written(older: PendingStep) -> None:
    newest = pending(4, 4)
    assert order.supersede_older([older, newest], newest) == []
    assert not older.superseded


def test_not_every_rank_handed_off_replacing_a_step_or_refused() -> None:
    half = pending(2, 2)
    half.writing.discard(1)  # rank 1 never handed off: it fails alone, in time
    replacing = pending(3, 3)
    replacing.replaces = Step("j", 3, state=pb.SAVE_STATE_LOCAL)
    refused = pending(3, 3)
    refused.supersedable = False  # its client asked for every save to be written
    newest = pending(4, 4)
    assert order.supersede_older([half, replacing, refused, newest], newest) == []


def test_a_step_waits_its_turn_and_a_superseded_one_never_begins() -> None:
    async def run() -> None:
        first, second = pending(1, 1), pending(2, 2)
        await order.turn([first, second], first)
        assert first.started
        waiting = asyncio.ensure_future(order.turn([first, second], second))
        await asyncio.sleep(0)
        assert not waiting.done() and not second.started
        first.settled.set()  # LOCAL
        await waiting
        assert second.started

        third, fourth = pending(3, 3), pending(4, 4)
        blocked = asyncio.ensure_future(order.turn([second, third, fourth], third))
        await asyncio.sleep(0)
        assert order.supersede_older([second, third, fourth], fourth) == [third]
        third.settled.set()  # the saver ends it
        with pytest.raises(order.Superseded):
            await blocked
        assert not third.started

    asyncio.run(run())
