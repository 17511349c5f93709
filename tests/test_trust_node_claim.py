"""Two daemons under one node name on one bucket: the name is claimed, never shared.

Against the real stores (file://, SeaweedFS S3, fake-gcs-server): the backends'
compare-and-swap, the claim's rules (refused while fresh, stale takeover, the same
root retaking at once, one winner of racing takeovers), and real ``ckptd serve``
processes: a second daemon with the same name saves locally but uploads nothing
and says why; it takes over once the first is gone and its claim is stale.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptd.daemon.app import config
from ckptd.daemon.remote.base import Remote
from ckptd.daemon.remote.claim import ClaimRecord, NodeClaim, claim_key

from .conftest import RemoteTarget
from .helpers import state_for
from .test_remote_tier import remote_daemon, wait_until

KEY = claim_key("n1")


class Clock:
    """A settable wall clock: staleness without waiting."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def claim(r: Remote, root_id: str, clock: Clock, **kw: Any) -> NodeClaim:
    return NodeClaim(r, "n1", root_id, 10.0, 30.0, clock=clock, **kw)


def test_conditional_writes_compare_and_swap(remote: RemoteTarget) -> None:
    async def body(r: Remote) -> None:
        assert r.conditional_writes
        assert await r.read_versioned(KEY) is None
        v1 = await r.write_if(KEY, b"one", None)
        assert v1 is not None
        assert await r.write_if(KEY, b"again", None) is None  # exists: create refused
        assert await r.read_versioned(KEY) == (b"one", v1)
        v2 = await r.write_if(KEY, b"two", v1)
        assert v2 is not None and v2 != v1
        assert await r.write_if(KEY, b"late", v1) is None  # stale version refused
        assert await r.read_versioned(KEY) == (b"two", v2)
        # Many writers replacing the same version at once: exactly one wins.
        won = await asyncio.gather(*(r.write_if(KEY, f"w{i}".encode(), v2) for i in range(6)))
        winners = [(i, v) for i, v in enumerate(won) if v is not None]
        assert len(winners) == 1, won
        i, v = winners[0]
        assert await r.read_versioned(KEY) == (f"w{i}".encode(), v)

    remote.run(body)


def test_claim_refused_while_fresh_then_taken_when_stale(remote: RemoteTarget) -> None:
    clock = Clock()

    async def body(r: Remote) -> None:
        first, second = claim(r, "root-a", clock), claim(r, "root-b", clock)
        assert await first.acquire()
        assert not await second.acquire()
        assert first.mine.host in second.reason and "node_id" in second.reason
        assert second.holder is not None and second.holder.instance == first.mine.instance
        clock.now += 20  # the holder's heartbeat keeps it
        assert await first.acquire()
        assert not await second.acquire()
        clock.now += 31  # the holder stopped without releasing: stale
        assert await second.acquire()
        # The old holder comes back: its heartbeat's precondition fails, it stops.
        assert not await first.acquire()
        assert not first.held and "another daemon" in first.reason
        data = await r.read_versioned(KEY)
        assert data is not None
        rec = ClaimRecord.parse(data[0])
        assert rec is not None and rec.instance == second.mine.instance

    remote.run(body)


def test_a_slow_holder_is_judged_by_its_own_heartbeat(remote: RemoteTarget) -> None:
    clock = Clock()

    async def body(r: Remote) -> None:
        slow = NodeClaim(r, "n1", "root-a", 100.0, 300.0, clock=clock)
        assert await slow.acquire()
        clock.now += 150  # past the reader's 30 s, within two of the holder's 100 s beats
        assert not await claim(r, "root-b", clock).acquire()
        clock.now += 51
        assert await claim(r, "root-b", clock).acquire()

    remote.run(body)


def test_same_root_retakes_at_once_and_release_hands_over(remote: RemoteTarget) -> None:
    clock = Clock()

    async def body(r: Remote) -> None:
        before = claim(r, "root-a", clock)
        assert await before.acquire()
        # A restart of the same daemon (same root id, new instance): at once, fresh claim.
        after = claim(r, "root-a", clock)
        assert await after.acquire()
        other = claim(r, "root-b", clock)
        assert not await other.acquire()
        await after.release()  # a clean stop
        assert await other.acquire()
        forced = claim(r, "root-c", clock, takeover=True)  # the operator's word
        assert await forced.acquire()

    remote.run(body)


def test_a_holder_that_died_on_this_host_is_taken_over_at_once(remote: RemoteTarget) -> None:
    """A daemon SIGKILLed here and started again on a new disk (a new root) need not
    wait for staleness: its claim names this boot, this pid namespace and a process
    that is gone. A twin on another host (another boot id) still has to wait."""
    clock = Clock()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a real process of this host, now exited: its pid names nobody

    async def body(r: Remote) -> None:
        dead = claim(r, "root-a", clock)
        dead.mine.pid, dead.mine.pid_started = child.pid, 1  # 1 tick after boot: not it
        assert await dead.acquire()
        twin = claim(r, "root-b", clock)
        twin.mine.boot_id = "another-host"
        assert not await twin.acquire()  # the holder ran elsewhere: wait for staleness
        here = claim(r, "root-c", clock)
        assert await here.acquire()  # same boot and namespace, process gone: at once
        assert not await claim(r, "root-d", clock).acquire()  # a live holder: refused

    remote.run(body)


def test_racing_takeovers_of_a_stale_claim_have_one_winner(remote: RemoteTarget) -> None:
    clock = Clock()

    async def body(r: Remote) -> None:
        assert await claim(r, "gone", clock).acquire()
        clock.now += 100
        racers = [claim(r, f"root-{i}", clock) for i in range(5)]
        held = await asyncio.gather(*(c.acquire() for c in racers))
        assert sum(held) == 1, held
        # Each loser, asking again, sees the winner's fresh claim and is refused.
        for c, won in zip(racers, held, strict=True):
            assert await c.acquire() == won

    remote.run(body)


def test_second_daemon_with_same_name_uploads_nothing_until_first_is_gone(
    make_daemon: Any, remote: RemoteTarget, tmp_path: Path
) -> None:
    # Both beat often; the first's claim is stale 10 s after its last heartbeat.
    fast = ["--node-claim-heartbeat-seconds", "0.5", "--node-claim-stale-seconds", "10"]
    first = remote_daemon(make_daemon, remote, extra_args=fast)
    first.client("j").save(1, state_for(1, 1)).wait("durable", 120)
    second = remote_daemon(make_daemon, remote, extra_args=fast)
    h = second.client("j").save(2, state_for(2, 1))
    h.wait("local", 60)  # saves to the local disk keep working
    wait_until(lambda: "held in" in second.status().drain_error, what="the refusal in status")
    why = second.status().drain_error
    assert "another daemon" in why and "node_id" in why, why
    assert h.state() == "LOCAL"
    assert not [k for k in remote.object_keys() if k.startswith("j/2/")]
    first.kill()  # gone without releasing: its claim goes stale
    h.wait("durable", 120)
    assert second.status().drain_error == ""


def test_restart_on_same_root_retakes_claim_at_once(make_daemon: Any, remote: RemoteTarget) -> None:
    # A stale time no test waits for: only the same-root rule can let it drain.
    slow = ["--node-claim-heartbeat-seconds", "600", "--node-claim-stale-seconds", "3600"]
    d = remote_daemon(make_daemon, remote, extra_args=slow)
    d.client("j").save(1, state_for(1, 1)).wait("durable", 120)
    d.kill()  # a crash: the claim is not released
    d.start()
    d.client("j").save(2, state_for(2, 1)).wait("durable", 120)


def test_config_keys_and_a_stale_time_below_the_heartbeat_refused() -> None:
    env = {"CKPTD_NODE_CLAIM_TAKEOVER": "true", "CKPTD_NODE_CLAIM_STALE_SECONDS": "60"}
    cfg = config.load(env=env, flags={"node_claim_heartbeat_seconds": "20"})
    assert cfg.node_claim_takeover and cfg.node_claim_stale_seconds == 60.0
    with pytest.raises(config.ConfigError, match=r"node_claim_stale_seconds.*three times"):
        config.load(env={}, flags={"node_claim_stale_seconds": "100"})
