"""Staging memory made and mapped ahead of a process's first saves (client/ahead.py),
against a real daemon: the saves take segments that exist and are mapped already,
so none makes fresh memory or maps a segment in the trainer's blocking time.

Whether a segment was made is read from the daemon's ``staging_segments_created``;
whether the client mapped one during a save, from the thread its mapping ran on.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from ckptd.client import Client

from .helpers import reservations_done

MiB = 2**20


def state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.random(MiB // 8) for i in range(4)}  # 4 MiB


def mapped_in_saves(client: Client, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The segments the client maps on the calling thread from now on (a save's)."""
    handoff = client._handoff
    real = handoff._open
    caller = threading.current_thread()
    seen: list[str] = []

    def opened(lease: Any) -> Any:
        if threading.current_thread() is caller:
            seen.append(lease.segment)
        return real(lease)

    monkeypatch.setattr(handoff, "_open", opened)
    return seen


def test_reserved_first_saves_make_and_map_nothing(
    make_daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = make_daemon()  # the memory tier on (the default): two segments rotate
    c = d.client("ahead")
    assert c.reserve(state(0)).result(timeout=120) == 2
    made = d.status().staging_segments_created + d.status().staging_spares_made
    seen = mapped_in_saves(c, monkeypatch)
    for step in range(4):
        c.save(step, state(step)).wait("local", timeout=120)
    st = d.status()
    assert st.staging_segments_created + st.staging_spares_made == made
    assert seen == []
    tree, _ = c.restore(step=3)
    assert all(np.array_equal(tree[k], v) for k, v in state(3).items())


def test_the_second_save_finds_its_segment_made_and_mapped(
    make_daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No reservation: the first save pays for its segment; the second's is made (a
    spare begun at the first's grant) and mapped (after the first) meanwhile."""
    d = make_daemon()
    c = d.client("second")
    c.save(0, state(0)).wait("local", timeout=120)
    reservations_done(c, 120)  # the second's reservation, done
    made = d.status().staging_segments_created + d.status().staging_spares_made
    seen = mapped_in_saves(c, monkeypatch)
    for step in (1, 2, 3):
        c.save(step, state(step)).wait("local", timeout=120)
    st = d.status()
    assert st.staging_segments_created + st.staging_spares_made == made == 2
    assert seen == []


def test_without_the_memory_tier_nothing_more_is_made(make_daemon: Any) -> None:
    d = make_daemon(extra_args=["--memory-tier-steps", "0"])
    c = d.client("plain")
    assert c.reserve(state(0)).result(timeout=120) == 1
    for step in range(3):
        c.save(step, state(step)).wait("local", timeout=120)
    st = d.status()
    assert (st.staging_segments_created, st.staging_spares_made) == (1, 0)


def test_a_reservation_never_pushes_out_what_the_memory_tier_keeps(make_daemon: Any) -> None:
    """The budget holds one kept segment and one save's: another job's reservation
    finds no room, and asks for nothing."""
    d = make_daemon(extra_args=["--staging-budget-bytes", str(9 * MiB)])
    a = d.client("kept")
    a.save(0, state(0)).wait("local", timeout=120)
    assert d.status().memory_tier_files == 1
    b = d.client("other")
    assert b.reserve({"x": np.zeros(6 * MiB // 8)}).result(timeout=120) == 0
    assert d.status().memory_tier_files == 1


def test_a_reservation_of_another_size_is_let_go(
    make_daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer saved more than it reserved (optimizer state made after): the
    reserved mappings are unmapped once two saves did not take them, and the second
    save's segment is made and mapped ahead all the same."""
    d = make_daemon()
    c = d.client("grown")
    assert c.reserve({"w": np.zeros(MiB // 8)}).result(timeout=120) == 2
    big = state(0)
    c.save(0, big).wait("local", timeout=120)
    reservations_done(c, 120)  # the second's, made
    seen = mapped_in_saves(c, monkeypatch)
    for step in (1, 2):
        c.save(step, state(step)).wait("local", timeout=120)
    assert seen == []
    assert c._handoff._premapped == {}


def test_a_restarted_trainer_restores_and_its_first_saves_make_and_map_nothing(
    make_daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new process's restore of its own rank tells the state's size: its first saves'
    segments are made and mapped ahead, as if it had called reserve()."""
    d = make_daemon()
    before = d.client("restarted")
    for step in (0, 1):
        before.save(step, state(step)).wait("local", timeout=120)
    before.close()
    c = d.client("restarted")
    tree, _ = c.restore()
    reservations_done(c, 120)
    made = d.status().staging_segments_created + d.status().staging_spares_made
    seen = mapped_in_saves(c, monkeypatch)
    for step in (2, 3, 4):
        c.save(step, {k: v + step for k, v in tree.items()}).wait("local", timeout=120)
    st = d.status()
    assert seen == []
    assert st.staging_segments_created + st.staging_spares_made == made
    back, _ = c.restore()  # a save came first: nothing more reserved
    reservations_done(c, 120)
    assert d.status().staging_segments_created + d.status().staging_spares_made == made
    assert all(np.array_equal(back[k], v + 4) for k, v in tree.items())
