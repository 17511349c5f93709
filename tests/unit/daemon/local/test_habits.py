"""Which saves scan the lease before they write (local/increment.py, ``Habits``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from ckptd.core import increments
from ckptd.daemon.local.increment import Habits, Scan, alike

KEYS = ["a", "b", "c"]


def _base(crcs: list[int], step: int = 1) -> Any:
    table = SimpleNamespace(keys=KEYS, crc32c=np.array(crcs))  # what candidates() reads
    previous = increments.Previous(step, None, [], table, None)  # type: ignore[arg-type]
    return SimpleNamespace(step=SimpleNamespace(step=step), previous=previous)


def _req(word: list[bool] | None = None, since: int = 1) -> Any:
    unchanged = None if word is None else np.array(word, bool)
    return SimpleNamespace(
        job="j",
        rank=0,
        table=SimpleNamespace(keys=KEYS),
        unchanged=unchanged,
        unchanged_since=since,
    )


def test_a_save_after_one_where_everything_changed_skips_the_scan_until_a_shard_repeats() -> None:
    habits, base = Habits(), _base([1, 2, 3])
    req = _req()
    assert habits.scans(req, base)  # nothing known yet
    habits.learn(req, base, alike(req, base, None, np.array([4, 5, 6])))  # every shard changed
    assert not habits.scans(req, base)
    assert habits.scans(_req(), None)  # no base: its digests serve the next save
    assert not habits.scans(_req([False, False, False]), base)  # the word: all changed
    assert habits.scans(_req([False, True, False]), base)  # the word: one unchanged
    assert not habits.scans(_req([False, True, False], since=0), base)  # a word of another step
    habits.learn(req, base, alike(req, base, None, np.array([4, 2, 6])))  # b may be unchanged
    assert habits.scans(req, base)
    other: Any = SimpleNamespace(**{**vars(req), "rank": 1})
    habits.learn(req, base, alike(req, base, None, np.array([7, 8, 9])))
    assert habits.scans(other, base)  # per rank


def test_a_scan_answers_for_itself_and_no_base_never_counts_as_changing() -> None:
    habits, base, req = Habits(), _base([1, 2, 3]), _req()
    assert alike(req, base, Scan([1, 9, 9], 0, None, True), np.array([0, 0, 0]))  # not re-read
    assert not alike(req, base, Scan([7, 8, 9], 0, None, False), np.array([1, 2, 3]))
    assert not alike(req, None, None, np.array([1, 2, 3]))
    habits.learn(req, None, False)  # a first save: nothing to compare with
    assert habits.scans(req, base)
