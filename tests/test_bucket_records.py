"""Records read from the bucket are bounded before use (remote/records.py).

Anyone who can write to the bucket can write any bytes under any key. A record
ckptd could not have written (a count past every wire field, a time that is NaN,
a string of megabytes, JSON nested past the parser's depth) is skipped and logged
once: it never fails a request, and never stops this daemon saving or uploading.
Real daemons on a file:// bucket, the poisoned record written straight into it.
"""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client import Client
from ckptd.core.manifest import Manifest, ManifestInvalid, RankRecord
from ckptd.daemon.api.history import JobHistory
from ckptd.daemon.remote import index
from ckptd.daemon.remote.base import Remote
from ckptd.daemon.remote.claim import ClaimRecord, NodeClaim, claim_key
from ckptd.daemon.remote.layout import manifest_key, parse_ranks_key
from ckptd.daemon.remote.node_fleet import FAILPOINT, NodeFleet
from ckptd.daemon.remote.read import parse_remote_manifest
from ckptd.proto import ckptd_pb2 as pb

from .conftest import RemoteTarget
from .test_remote_tier import remote_daemon

NODE = "test-node"
MAX_COUNT = 2**32
"""Most replacements one node record may count (remote/records.py)."""
MAX_METRICS = 512
"""Most metrics one step may carry (a save's 256 and the daemon's own)."""
HONEST: dict[str, Any] = {
    "node": "other",
    "instance": "i-other",
    "root_id": "root-other",
    "host": "host-other",
    "pid": 4242,
    "started_unix": 1.7e9,
    "heartbeat_unix": 1.7e9,
    "heartbeat_seconds": 300.0,
    "since_unix": 1.7e9,
    "replacements": 1,
    "replaced_unix": [1.7e9],
}
"""A claim of another node name, as a daemon writes it."""
POISONS: dict[str, dict[str, Any]] = {
    "replacements past uint64": {"replacements": 10**30},
    "since NaN": {"since_unix": math.nan},
    "since before 1970": {"since_unix": -1e300},
    "replaced at inf": {"replaced_unix": [math.inf]},
    "heartbeat as text": {"heartbeat_unix": "soon"},
    "a host of a megabyte": {"host": "h" * 2**20},
    "pid past pid_t": {"pid": 2**70},
}


def bucket(tmp_path: Path) -> RemoteTarget:
    return RemoteTarget("file", f"file://{tmp_path}/bucket", {})


def plant(remote: RemoteTarget, key: str, data: bytes) -> None:
    """Write a claim the way every daemon does (a conditional write: on file:// a
    folder of generations), so the poison is read as a claim."""

    async def body(r: Remote) -> None:
        assert await r.write_if(key, data, None) is not None

    remote.run(body)


def record(**fields: Any) -> bytes:
    return json.dumps({**HONEST, **fields}).encode()


def history(client: Client, job: str) -> pb.JobHistory:
    return client.connection.list_checkpoints(pb.ListCheckpointsRequest(job=job)).history


def sane(h: pb.JobHistory, names: int) -> None:
    """The node fields as a daemon with ``names`` readable node records sends them."""
    assert math.isfinite(h.node_observed_seconds) and h.node_observed_seconds >= 0
    assert h.node_replacements < MAX_COUNT * names
    assert h.node_names == names


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_poisoned_record_of_another_node_name_breaks_no_listing(
    make_daemon: Any, tmp_path: Path, poison: str
) -> None:
    remote = bucket(tmp_path)
    plant(remote, claim_key("other"), record(**POISONS[poison]))
    d = remote_daemon(make_daemon, remote, failpoints=f"{FAILPOINT}=pause")
    d.wait_failpoint(FAILPOINT)  # the fleet has read the poisoned record
    d.release(FAILPOINT)
    client = d.client("resume")
    client.save(1, {"w": np.arange(64.0)}).wait("durable")
    assert [c.step for c in client.list()] == [1]  # what every framework's resume calls
    sane(history(client, "resume"), names=1)  # this node's claim; the poisoned one skipped
    assert d.running()


def test_an_honest_record_of_another_node_name_is_counted(make_daemon: Any, tmp_path: Path) -> None:
    """The same path as above with the record a daemon writes: it is sampled (the
    test above would pass on a fleet that sampled nothing)."""
    remote = bucket(tmp_path)
    plant(remote, claim_key("other"), record())
    d = remote_daemon(make_daemon, remote, failpoints=f"{FAILPOINT}=pause")
    d.wait_failpoint(FAILPOINT)
    d.release(FAILPOINT)
    client = d.client("resume")
    client.save(1, {"w": np.arange(64.0)}).wait("durable")
    h = history(client, "resume")
    assert (h.node_names, h.node_replacements) == (2, 1)


OWN_POISONS: dict[str, bytes] = {
    # Stale (a heartbeat long ago) with a history no daemon can have written.
    "history": record(node=NODE, replacements=10**30, since_unix=math.nan, heartbeat_unix=1e9),
    # A heartbeat that is no time: never stale by arithmetic, so never taken.
    "heartbeat NaN": record(node=NODE, heartbeat_unix=math.nan),
    # Nested past the JSON parser's depth: RecursionError, not ValueError.
    "nested": b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("poison", sorted(OWN_POISONS))
def test_a_poisoned_record_of_its_own_node_name_is_taken_over(
    make_daemon: Any, tmp_path: Path, poison: str
) -> None:
    """The claim of this daemon's own name, poisoned: not ckptd's record, so taken over
    at once (as an unreadable one always was); the daemon saves, uploads and lists,
    and the record it writes back carries nothing of the poison."""
    remote = bucket(tmp_path)
    plant(remote, claim_key(NODE), OWN_POISONS[poison])
    d = remote_daemon(make_daemon, remote)
    client = d.client("own")
    client.save(1, {"w": np.arange(64.0)}).wait("durable", timeout=60)
    assert [c.step for c in client.list()] == [1]
    h = history(client, "own")
    sane(h, names=1)
    assert h.node_replacements <= 1

    async def stored(r: Remote) -> ClaimRecord | None:
        got = await r.read_versioned(claim_key(NODE))
        return ClaimRecord.parse(got[0]) if got else None

    mine = remote.run(stored)
    assert mine is not None and math.isfinite(mine.since_unix) and mine.replacements <= 1


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_claim_records_out_of_bounds_are_not_records(poison: str) -> None:
    assert ClaimRecord.parse(record()) is not None
    assert ClaimRecord.parse(record(**POISONS[poison])) is None


def test_a_poisoned_sample_is_skipped_and_logged_once(tmp_path: Path, caplog: Any) -> None:
    caplog.set_level(logging.WARNING, "ckptd")

    async def body(r: Remote) -> None:
        await r.write_if(claim_key("other"), record(), None)
        poisoned = record(node="poisoned", replacements=10**30)
        await r.write_if(claim_key("poisoned"), poisoned, None)
        await r.write_if(claim_key("copied"), record(), None)  # another name's record
        mine = NodeClaim(r, "n1", "root-a", 10.0, 30.0, clock=lambda: 1.7e9 + 5)
        assert await mine.acquire()
        fleet = NodeFleet(r, mine, lambda: 1.7e9 + 5, random.Random(1))
        for _ in range(3):  # hourly in a daemon: the warning is not repeated
            await fleet.sample()
            assert [o.node for o in fleet.others] == ["other"]
        assert fleet.totals() == (5.0, 1, 2)

    bucket(tmp_path).run(body)
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 2, [r.getMessage()[:200] for r in warned]  # one per bad record


def test_the_carried_record_saturates() -> None:
    mine = ClaimRecord.parse(record())
    prev = ClaimRecord.parse(record(replacements=MAX_COUNT - 1))
    assert mine is not None and prev is not None
    mine.carry(prev, True, 1.7e9 + 10)
    assert mine.replacements == MAX_COUNT - 1  # never a count the next reader refuses
    assert ClaimRecord.parse(mine.to_bytes()) is not None


def test_the_job_history_message_never_overflows(tmp_path: Path) -> None:
    """Whatever the node record or the local file say, ListCheckpoints' history is a
    message the wire can carry (defence in depth: both are bounded where read)."""
    h = JobHistory(nodes=lambda: (math.nan, 10**30, 2**40))
    h.seen("j")
    msg = h.message("j")
    assert msg.node_observed_seconds == 0.0 and msg.node_replacements == 2**64 - 1
    assert msg.node_names == 2**32 - 1
    path = tmp_path / "history.json"
    doc = {
        "first_seen": math.nan,
        "active": 1.0,
        "stretch": 0.0,
        "last_used": 0.0,
        "restores": {"0": 10**30},
        "restart_times": [math.inf],
    }
    path.write_text(json.dumps({"version": 1, "jobs": {"j": doc}}))
    loaded = JobHistory(path)  # set aside: not a record this daemon writes
    assert loaded.message("j") == pb.JobHistory()


def test_index_and_marker_entries_are_bounded() -> None:
    entry = index._entry(
        {
            "step": 7,
            "created_unix": 1e300,
            "metrics": {"m" * 300: 1.0, **{f"k{i}": float(i) for i in range(600)}},
        }
    )
    assert entry is not None and entry.created_unix == 0.0
    assert len(entry.metrics) == MAX_METRICS and all(len(k) <= 255 for k in entry.metrics)
    assert index._entry({"step": 7, "created_unix": -5.0}).created_unix == 0.0  # type: ignore[union-attr]
    # A marker: the same bounds (its time field too).
    marker = index.marker_entry(3, False, json.dumps({"time": 1e300}).encode())
    assert marker.created_unix == 0.0
    nested = index.marker_entry(3, False, b"[" * 100_000 + b"]" * 100_000)
    assert nested.step == 3 and nested.created_unix == 0.0
    # Each a ValueError, so the node's own index is rebuilt from its markers (a
    # TypeError or RecursionError failed every drain of the job that adds to it).
    for bad in (b"[" * 100_000 + b"]" * 100_000, b'{"format": 1, "steps": 5}'):
        with pytest.raises(ValueError):
            index.decode(bad)


def test_ranks_records_are_bounded() -> None:
    assert parse_ranks_key("j/1/n/ranks-0-7") == ("n", 0, 7)
    assert parse_ranks_key(f"j/1/n/ranks-0-{10**40}") is None
    assert parse_ranks_key("j/1/n/ranks-7-0") is None


def _manifest(**fields: Any) -> bytes:
    """A valid manifest of ``j/1`` node ``n``, with ``fields`` replaced."""
    rank = RankRecord(0, "rank-00000.safetensors", 0, 0, None)
    body = json.loads(Manifest("j", 1, "n", 1, 1.7e9, [rank]).to_json())
    return json.dumps({**body, **fields}).encode()


@pytest.mark.parametrize(
    "fields",
    [
        {"metrics": {"m" * 300: 1.0}},
        {"metrics": {f"k{i}": 1.0 for i in range(MAX_METRICS + 1)}},
        {"source": "/" + "d" * 5000},
        {"created_unix": -1.0},
        {"created_unix": 1e300},
    ],
    ids=["metric-name", "metrics", "source", "created-negative", "created-huge"],
)
def test_a_bucket_manifest_out_of_bounds_is_corrupt(fields: dict[str, Any]) -> None:
    key = manifest_key("j", 1, "n")
    assert parse_remote_manifest(_manifest(), key, "j", 1, "n", False).step == 1
    with pytest.raises(ManifestInvalid):
        parse_remote_manifest(_manifest(**fields), key, "j", 1, "n", False)


def test_an_s3_checksum_in_metadata_that_is_no_crc32c_is_none() -> None:
    """Only the drain's check of an object it may skip reads it: a bad value there
    means "upload again", never an upload that fails for ever."""
    import asyncio

    from ckptd.daemon.remote.s3 import META_CRC, S3Remote

    def crc(head: dict[str, Any]) -> int | None:
        r = S3Remote.open("s3://b/p", "http://127.0.0.1:9", 5 * 2**20, 1)

        async def answer(method: str, **kw: Any) -> dict[str, Any]:
            return head

        r._s3 = answer  # type: ignore[method-assign]
        return asyncio.run(r.native_crc32c("k"))

    assert crc({"Metadata": {META_CRC: "123"}}) == 123
    assert crc({"ChecksumCRC32C": "AAAAew=="}) == 123
    for bad in ("x", "1e3", str(2**40), "9" * 5000, "-1"):
        assert crc({"Metadata": {META_CRC: bad}}) is None
    assert crc({"ChecksumCRC32C": "A"}) is None  # binascii.Error
