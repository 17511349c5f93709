"""The jobs' own retention (retention/jobs.py): the tiers it makes, its file, its
record in the bucket, the operator's limits."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from ckptd.core.errors import FailedPrecondition, InvalidArgument
from ckptd.daemon.retention.jobs import FILE, JobRetention, KeepAtMost, KeepBoth
from ckptd.daemon.retention.policies import Checkpoint, KeepEverySteps, KeepLatest, parse_policy

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

    async def scenario() -> None:
        first = JobRetention(tmp_path / "a", remote=remote)  # type: ignore[arg-type]
        (tmp_path / "a").mkdir()
        remote.down = True
        await first.set_everywhere("j", "KeepLatest(6)")  # applied here, the bucket behind
        assert "j/_retention.json" not in remote.objects
        remote.down = False
        await first.sync()  # the evictor's next pass
        assert json.loads(remote.objects["j/_retention.json"]) == {"policy": "KeepLatest(6)"}
        # A replacement node's daemon: nothing on its disk, the job's policy in the bucket.
        (tmp_path / "b").mkdir()
        fresh = JobRetention(tmp_path / "b", remote=remote)  # type: ignore[arg-type]
        remote.down = True
        assert not await fresh.settled("j")  # unknown yet: the job's bucket copies wait
        remote.down = False
        assert await fresh.settled("j") and await fresh.settled("other")
        policy = fresh.policy("j")
        assert policy is not None and policy.describe() == "KeepLatest(6)"
        await first.set_everywhere("j", "")
        assert "j/_retention.json" not in remote.objects

    asyncio.run(scenario())
