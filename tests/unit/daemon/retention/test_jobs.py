"""The jobs' own retention (retention/jobs.py): the tiers it makes, its file, its
record in the bucket, the operator's limits."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from ckptd.core.errors import FailedPrecondition, InvalidArgument
from ckptd.daemon.retention.jobs import FILE, JobRetention, KeepAtMost, KeepBoth
from ckptd.daemon.retention.policies import (
    Checkpoint,
    KeepAll,
    KeepEverySteps,
    KeepLatest,
    parse_policy,
)

CKPTS = [Checkpoint(step, float(step)) for step in range(1, 11)]


def test_keep_both_and_keep_at_most() -> None:
    both = KeepBoth(KeepLatest(4), KeepEverySteps(2))
    assert both.keep(CKPTS, 0.0) == {
        8: {"latest", "every-2-steps"},
        10: {"latest", "every-2-steps"},
    }
    assert sorted(KeepAtMost(KeepEverySteps(2), 3).keep(CKPTS, 0.0)) == [6, 8, 10]
    assert KeepAtMost(KeepLatest(1), 2).describe() == "KeepAtMost(KeepLatest(1), 2)"


def test_the_tiers_it_makes(tmp_path: Path) -> None:
    jobs = JobRetention(tmp_path)
    node_local, node_remote = KeepLatest(2), parse_policy("KeepLatest(3)")
    assert jobs.tiers("a", node_local, node_remote) == (node_local, node_remote)
    jobs.set("a", "KeepLatest(7)")
    local, remote = jobs.tiers("a", node_local, node_remote)
    assert remote is not None and remote.describe() == "KeepAny([KeepLatest(7), KeepMilestones()])"
    assert isinstance(local, KeepBoth) and local.first is node_local
    alone, none = jobs.tiers("a", node_local, None)  # no bucket: the disk is durable
    assert none is None and alone.describe() == remote.describe()
    assert jobs.tiers("b", node_local, node_remote) == (node_local, node_remote)


def test_kept_in_its_file_across_restarts(tmp_path: Path) -> None:
    jobs = JobRetention(tmp_path)
    jobs.set("a", "KeepLatest(7)")
    jobs.set("b", "KeepBest('loss', 2)")
    jobs.set("b", "")  # back to the node's
    saved = json.loads((tmp_path / FILE).read_text())
    assert saved == {"jobs": {"a": "KeepLatest(7)"}}
    again = JobRetention(tmp_path, max_steps=4)
    policy = again.policy("a")
    assert policy is not None and policy.describe() == "KeepAtMost(KeepLatest(7), 4)"
    assert again.policy("b") is None
    (tmp_path / FILE).write_text("{not json")
    assert JobRetention(tmp_path).policy("a") is None  # unreadable: logged, node's policy


def test_refusals(tmp_path: Path) -> None:
    jobs = JobRetention(tmp_path)
    with pytest.raises(InvalidArgument, match="unknown policy"):
        jobs.set("a", "KeepSome(3)")
    with pytest.raises(InvalidArgument, match="at most"):
        jobs.set("a", "KeepLatest(1)," * 1000)
    off = JobRetention(tmp_path, allowed=False)
    with pytest.raises(FailedPrecondition, match="job_retention = false"):
        off.set("a", "KeepLatest(3)")
    assert off.set("a", "") is None


class Bucket:
    """A remote tier's small-object calls, in memory; ``down`` makes them fail."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.down = False

    async def put_bytes(self, key: str, data: bytes) -> None:
        self._check()
        self.objects[key] = data

    async def get_bytes(self, key: str) -> bytes:
        self._check()
        if key not in self.objects:
            raise FileNotFoundError(key)
        return self.objects[key]

    async def delete(self, keys: list[str]) -> None:
        self._check()
        for k in keys:
            self.objects.pop(k, None)

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, ConnectionError)

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("the bucket does not answer")


def test_the_buckets_record(tmp_path: Path) -> None:
    remote = Bucket()
    key = "j/_retention/node-a.json"

    async def scenario() -> None:
        (tmp_path / "a").mkdir()
        first = JobRetention(tmp_path / "a", remote=remote, node="node-a")  # type: ignore[arg-type]
        remote.down = True
        await first.set_everywhere("j", "KeepLatest(6)")  # applied here, the bucket behind
        assert key not in remote.objects
        remote.down = False
        await first.sync()  # the evictor's next pass
        assert json.loads(remote.objects[key]) == {"policy": "KeepLatest(6)"}
        remote.objects[key] = b"tampered"  # unchanged policy: not written again
        await first.set_everywhere("j", "KeepLatest(6)")
        assert remote.objects[key] == b"tampered"
        # A restart writes every record again (one may have been missed before it).
        again = JobRetention(tmp_path / "a", remote=remote, node="node-a")  # type: ignore[arg-type]
        await again.sync()
        assert json.loads(remote.objects[key]) == {"policy": "KeepLatest(6)"}
        # A replacement node's daemon (the same node name): nothing on its disk, the
        # job's policy in the bucket. Until it is read, the bucket wants every step.
        (tmp_path / "b").mkdir()
        fresh = JobRetention(tmp_path / "b", remote=remote, node="node-a")  # type: ignore[arg-type]
        assert fresh.tiers("j", KeepLatest(2), KeepLatest(3))[1] == KeepAll()
        remote.down = True
        assert not await fresh.settled("j")  # unknown yet: the job's bucket copies wait
        remote.down = False
        assert await fresh.settled("j") and await fresh.settled("other")
        policy = fresh.policy("j")
        assert policy is not None and policy.describe() == "KeepLatest(6)"
        assert fresh.tiers("other", KeepLatest(2), KeepLatest(3)) == (KeepLatest(2), KeepLatest(3))
        # Another node's record is not this node's: never read.
        elsewhere = JobRetention(None, remote=remote, node="node-b")  # type: ignore[arg-type]
        assert await elsewhere.settled("j") and elsewhere.policy("j") is None
        await first.set_everywhere("j", "")
        assert key not in remote.objects

    asyncio.run(scenario())


def test_a_policy_set_while_the_record_is_read_wins(tmp_path: Path) -> None:
    jobs = JobRetention(None, remote=None, node="n")

    class Racing(Bucket):
        async def get_bytes(self, key: str) -> bytes:
            jobs.set("j", "KeepLatest(9)")  # a trainer's SetRetention lands meanwhile
            return json.dumps({"policy": "KeepLatest(1)"}).encode()

    jobs.remote = Racing()  # type: ignore[assignment]
    assert asyncio.run(jobs.settled("j"))
    policy = jobs.policy("j")
    assert policy is not None and policy.describe() == "KeepLatest(9)"


def test_a_bucket_error_keeps_the_jobs_copies(tmp_path: Path) -> None:
    class Denied(Bucket):
        async def get_bytes(self, key: str) -> bytes:
            raise PermissionError(key)

    jobs = JobRetention(None, remote=Denied(), node="n")  # type: ignore[arg-type]
    assert not asyncio.run(jobs.settled("j")) and not jobs.known("j")
    assert jobs.tiers("j", KeepLatest(1), KeepLatest(1))[1] == KeepAll()


def test_floor_and_abandoned_timelines(tmp_path: Path) -> None:
    jobs = JobRetention(tmp_path, floor=KeepEverySteps(5))
    jobs.set("j", "KeepLatest(1)")
    _, remote = jobs.tiers("j", KeepLatest(2), KeepLatest(3))
    assert remote is not None and sorted(remote.keep(CKPTS, 0.0)) == [5, 10]
    old_local, old_remote = jobs.abandoned("j", KeepLatest(2), KeepLatest(3))
    assert old_remote is not None and sorted(old_remote.keep(CKPTS, 0.0)) == [5, 8, 9, 10]
    assert sorted(old_local.keep(CKPTS, 0.0)) == [9, 10]
    assert jobs.abandoned("k", KeepLatest(2), None) == (KeepLatest(2), None)
