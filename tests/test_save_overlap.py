"""What a save overlaps to block the trainer less: its lease is asked for while the
tree is planned (sized as the last save was), and the watch of each save's stage
runs on threads kept for the next. Whatever the guess, every step restores
bit-exact and no lease is left held."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest

from ckptd.client import Client
from ckptd.client.handle import WATCHERS
from ckptd.proto import ckptd_pb2 as pb

from .conftest import Daemon
from .helpers import reservations_done


def leases_back(daemon: Daemon) -> None:
    """Until the daemon holds no lease (a status field; fails after a minute)."""
    done = threading.Event()
    for _ in range(600):
        if daemon.status().leases_held == 0:
            return
        done.wait(0.1)
    raise AssertionError(f"{daemon.status().leases_held} leases still held")


def state(seed: int, n: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal(4096 + i, np.float32) for i in range(n)}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes() for k in a
    )


class Blocking:
    """An array leaf whose conversion waits until ``sent`` is set: planning cannot
    finish before the lease is asked for."""

    def __init__(self, data: np.ndarray, sent: threading.Event) -> None:
        self.data, self.sent = data, sent

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if not self.sent.wait(60):
            raise AssertionError("the lease was not asked for while the tree was planned")
        return self.data


def test_the_lease_is_asked_for_while_the_tree_is_planned(daemon: Daemon) -> None:
    client = daemon.client("overlap")
    first = state(1)
    client.save(1, first).wait("local", timeout=60)
    sent = threading.Event()
    conn = client.connection
    acquire = conn.acquire_lease

    def acquire_lease(req: pb.AcquireLeaseRequest, *a: Any, **kw: Any) -> pb.Lease:
        sent.set()
        return acquire(req, *a, **kw)

    conn.acquire_lease = acquire_lease  # type: ignore[method-assign]
    second = state(2)
    tree = {**{k: v for k, v in second.items() if k != "w3"}, "w3": Blocking(second["w3"], sent)}
    client.save(2, tree).wait("local", timeout=60)
    got, _ = client.restore(step=2)
    assert same(got, second)
    client.close()
    leases_back(daemon)


def test_a_save_of_another_size_gives_the_early_lease_back(daemon: Daemon) -> None:
    client = daemon.client("resized")
    states = [state(1), state(2, n=20), state(3, n=3), state(4, n=3)]
    for step, s in enumerate(states, 1):
        client.save(step, s).wait("local", timeout=60)
        got, _ = client.restore(step=step)  # (retention keeps the newest few)
        assert same(got, s)
    leases_back(daemon)
    client.close()


def test_a_save_whose_plan_fails_gives_the_early_lease_back(daemon: Daemon) -> None:
    client = daemon.client("refused")
    client.save(1, state(1)).wait("local", timeout=60)
    leases_back(daemon)
    with pytest.raises(TypeError, match="cannot store"):
        client.save(2, {**state(2), "bad": object()})
    leases_back(daemon)  # the early lease went back once granted
    client.save(3, state(3)).wait("local", timeout=60)
    got, _ = client.restore(step=3)
    assert same(got, state(3))
    client.close()
    leases_back(daemon)


def test_a_busy_lease_thread_does_not_hold_planning_back(daemon: Daemon) -> None:
    """The lease thread may still wait for memory for a save whose plan failed: the
    next save plans (here: is refused) without waiting for it, and its lease is asked
    for once the thread is free."""
    client = daemon.client("busy")
    client.save(1, state(1)).wait("local", timeout=60)
    release = threading.Event()
    busy = client._saver._leaser.submit(release.wait, 120)
    try:
        with pytest.raises(TypeError, match="cannot store"):
            client.save(2, {**state(2), "bad": object()})
    finally:
        release.set()
    busy.result()
    leases_back(daemon)  # that save's early lease, granted after, went back
    client.save(3, state(3)).wait("local", timeout=60)
    got, _ = client.restore(step=3)
    assert same(got, state(3))
    client.close()
    leases_back(daemon)


def test_watch_threads_are_kept_for_the_next_saves(daemon: Daemon) -> None:
    client = daemon.client("watched")
    before = {t for t in threading.enumerate() if t.name == "ckptd-watch"}  # earlier tests'
    seen: set[threading.Thread] = set()
    for step in range(1, 9):
        handle = client.save(step, state(step))  # starts watching its stage
        seen.update(t for t in threading.enumerate() if t.name == "ckptd-watch")
        handle.wait("local", timeout=60)
    # A thread a save (as Thread.start() each time) would be 8 new ones; a watch still
    # finishing its last call when the next save comes (a busy machine) takes another.
    assert seen and len(seen - before) <= 4, (seen, before)
    client.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_watch_threads_of_its_own(daemon: Daemon) -> None:
    parent = daemon.client("forking")
    parent.save(1, state(1)).wait("local", timeout=60)
    done = threading.Event()
    for _ in range(600):  # until the parent has a watch thread, idle (white-box)
        if WATCHERS._idle:
            break
        done.wait(0.1)
    assert WATCHERS._idle
    # The parent's reservation for its second save (gRPC calls on its lease thread)
    # done first: a fork while another thread is inside a gRPC call leaves the
    # child's gRPC unusable (it aborts), whatever the client does.
    reservations_done(parent)
    pid = os.fork()
    if pid == 0:  # the child: its watch must run though the parent's thread is not here
        code = 1
        try:
            with Client("forked", socket=daemon.socket) as child:
                child.save(1, state(2))  # starts watching for LOCAL: seen, or never
                pause = threading.Event()
                for _ in range(600):
                    if child._saver.previous_reached("local"):
                        code = 0
                        break
                    pause.wait(0.1)
                else:
                    code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    parent.close()
