"""The node name's record in its claim (remote/claim.py) and the fleet's sample of
it (remote/node_fleet.py): the node-loss rate that outlives a lost node.

On a file:// bucket (the claim's compare-and-swap is the same code on every store:
tests/test_trust_node_claim.py runs those against S3 and GCS too), with a settable
clock: a node loss is a new root taking over a claim whose holder did not release it.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

from ckptd.daemon.remote import node_fleet
from ckptd.daemon.remote.base import Remote
from ckptd.daemon.remote.claim import REPLACED_KEPT, ClaimRecord, NodeClaim, claim_key
from ckptd.daemon.remote.node_fleet import SAMPLE, NodeFleet

from ....conftest import RemoteTarget


class Clock:
    """A settable wall clock."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def claim(r: Remote, root_id: str, clock: Clock, node: str = "n1", **kw: Any) -> NodeClaim:
    return NodeClaim(r, node, root_id, 10.0, 30.0, clock=clock, **kw)


async def stored(r: Remote, node: str = "n1") -> ClaimRecord:
    got = await r.read_versioned(claim_key(node))
    assert got is not None
    rec = ClaimRecord.parse(got[0])
    assert rec is not None
    return rec


def bucket(tmp_path: Path) -> RemoteTarget:
    return RemoteTarget("file", f"file://{tmp_path}/bucket", {})


def test_only_a_new_root_taking_an_unreleased_claim_counts_a_replacement(
    tmp_path: Path,
) -> None:
    clock = Clock()
    start = clock.now

    async def body(r: Remote) -> None:
        first = claim(r, "root-a", clock)
        assert await first.acquire()
        assert (await stored(r)).since_unix == start
        clock.now += 5
        assert await first.acquire()  # a heartbeat carries the record, adds nothing
        assert (await stored(r)).replacements == 0
        # The same root again (a daemon restart on the same disk): not a node loss.
        clock.now += 5
        assert await claim(r, "root-a", clock).acquire()
        assert (await stored(r)).replacements == 0
        # The holder stops without releasing; a new disk takes the stale claim: a loss.
        clock.now += 100
        lost_at = clock.now
        second = claim(r, "root-b", clock)
        assert await second.acquire()
        rec = await stored(r)
        assert (rec.since_unix, rec.replacements, rec.replaced_unix) == (start, 1, [lost_at])
        clock.now += 5
        assert await second.acquire()  # heartbeats carry it on
        assert (await stored(r)).replacements == 1
        # A clean release, then a new root: a planned move, not counted.
        await second.release()
        assert await claim(r, "root-c", clock).acquire()
        rec = await stored(r)
        assert (rec.since_unix, rec.replacements) == (start, 1)
        # The operator's takeover of a live holder by a new root: a replacement.
        assert await claim(r, "root-d", clock, takeover=True).acquire()
        assert (await stored(r)).replacements == 2

    bucket(tmp_path).run(body)


def test_the_replacement_times_kept_are_the_newest(tmp_path: Path) -> None:
    clock = Clock()

    async def body(r: Remote) -> None:
        for i in range(REPLACED_KEPT + 3):
            assert await claim(r, f"root-{i}", clock, takeover=True).acquire()
            clock.now += 1
        rec = await stored(r)
        assert rec.replacements == REPLACED_KEPT + 2  # the first claim was free
        assert len(rec.replaced_unix) == REPLACED_KEPT
        assert rec.replaced_unix[-1] == clock.now - 1

    bucket(tmp_path).run(body)


def test_a_record_written_before_the_history_parses_and_is_carried(tmp_path: Path) -> None:
    old = {
        "node": "n1",
        "instance": "i0",
        "root_id": "root-old",
        "host": "h",
        "pid": 1,
        "started_unix": 500.0,
        "heartbeat_unix": 500.0,
    }
    rec = ClaimRecord.parse(json.dumps(old).encode())
    assert rec is not None
    assert (rec.since_unix, rec.replacements, rec.replaced_unix) == (500.0, 0, [])
    bad = ClaimRecord.parse(json.dumps({**old, "replaced_unix": ["x"]}).encode())
    assert bad is None  # unreadable: taken over as before
    clock = Clock()

    async def body(r: Remote) -> None:
        await r.write_if(claim_key("n1"), json.dumps(old).encode(), None)
        assert await claim(r, "root-new", clock).acquire()  # stale since 500
        new = await stored(r)
        assert (new.since_unix, new.replacements) == (500.0, 1)

    bucket(tmp_path).run(body)


def test_the_fleet_sample_sums_this_node_and_at_most_sixteen_others(tmp_path: Path) -> None:
    clock = Clock()

    async def body(r: Remote) -> None:
        # 20 other node names, each claimed 100 s before this one, one replacement each.
        for i in range(20):
            other = claim(r, f"root-o{i}", clock, node=f"other-{i}")
            assert await other.acquire()
            assert await claim(r, f"root-p{i}", clock, node=f"other-{i}", takeover=True).acquire()
        mine = claim(r, "root-a", clock)
        fleet = NodeFleet(r, mine, clock, random.Random(3))
        assert fleet.totals() == (0.0, 0, 0)  # nothing held, nothing sampled
        clock.now += 100
        assert await mine.acquire()
        assert fleet.totals() == (0.0, 0, 1)  # this node's own claim, just taken
        await fleet.sample()
        assert len(fleet.others) == SAMPLE
        assert all(rec.node != "n1" for rec in fleet.others)
        clock.now += 50
        # each of the SAMPLE + 1 names ages a second a second (the client carries it on)
        assert fleet.totals() == (50.0 + SAMPLE * 150.0, SAMPLE, SAMPLE + 1)

    bucket(tmp_path).run(body)


def test_a_failing_sample_is_taken_again_later(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(node_fleet, "RETRY_SECONDS", 0.0)  # no waiting in a test
    monkeypatch.setattr(node_fleet, "START_JITTER_SECONDS", 0.0)
    clock = Clock()

    class FailsOnce:
        url = "file:///flaky"

        def __init__(self) -> None:
            self.calls = 0
            self.answered = asyncio.Event()

        async def list_dirs(self, prefix: str) -> list[str]:
            self.calls += 1
            if self.calls == 1:
                raise OSError("the store is down")
            self.answered.set()
            return []

    async def body(r: Remote) -> None:
        mine = claim(r, "root-a", clock)
        assert await mine.acquire()
        store = FailsOnce()
        fleet = NodeFleet(store, mine, clock)  # type: ignore[arg-type]
        task = asyncio.create_task(fleet.run())
        await asyncio.wait_for(store.answered.wait(), 60)  # the retry, after the failure
        fleet.stop()
        await task  # the failure did not end the loop with an error
        assert store.calls == 2 and fleet.others == []

    bucket(tmp_path).run(body)
