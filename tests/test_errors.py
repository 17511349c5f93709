"""Bad input gets a clear gRPC status and the daemon keeps serving."""

from __future__ import annotations

import json
import os
from typing import Any

import grpc
import numpy as np
import pytest

from ckptd.client import CheckpointNotFound, CkptdError
from ckptd.client.handle import SaveHandle
from ckptd.proto import PROTOCOL_HEADER
from ckptd.proto import ckptd_pb2 as pb

from .conftest import META, Daemon

LONG = "x" * 300


def good_request(stub: Any, job: str = "errs", step: int = 1) -> pb.CommitShardsRequest:
    lease = stub.AcquireLease(pb.AcquireLeaseRequest(job=job, size_bytes=8192), metadata=META)
    return pb.CommitShardsRequest(
        lease_id=lease.lease_id,
        job=job,
        step=step,
        rank=0,
        node_ranks=[0],
        world_size=1,
        shards=[
            pb.ShardDescriptor(key="a", dtype="<f4", shape=[4], offset=0, length=16),
            pb.ShardDescriptor(key="b", dtype="<i8", shape=[2], offset=16, length=16),
        ],
    )


def expect(code: grpc.StatusCode, match: str, fn: Any, *args: Any, **kw: Any) -> str:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, metadata=kw.pop("metadata", META), **kw)
    assert info.value.code() == code, info.value.details()
    details: str = info.value.details()
    assert match in details, details
    return details


def still_serving(daemon: Daemon) -> None:
    client = daemon.client("alive")
    step = len(client.list())
    client.save(step, {"x": np.arange(3)}).wait("local", timeout=30)
    assert daemon.proc is not None and daemon.proc.poll() is None


def mutate(req: pb.CommitShardsRequest, **changes: Any) -> pb.CommitShardsRequest:
    out = pb.CommitShardsRequest()
    out.CopyFrom(req)
    for path, value in changes.items():
        target: Any = out
        *parents, leaf = path.split("__")
        for p in parents:
            target = (
                target.shards[int(p[1:])]
                if p.startswith("s") and p[1:].isdigit()
                else getattr(target, p)
            )
        if isinstance(value, list):
            del getattr(target, leaf)[:]
            getattr(target, leaf).extend(value)
        else:
            setattr(target, leaf, value)
    return out


BAD_COMMITS = [
    ("job with slash", {"job": "a/b"}, grpc.StatusCode.INVALID_ARGUMENT, "path separator"),
    ("job with dotdot", {"job": ".."}, grpc.StatusCode.INVALID_ARGUMENT, "'..'"),
    ("job with NUL", {"job": "a\x00b"}, grpc.StatusCode.INVALID_ARGUMENT, "NUL"),
    ("job too long", {"job": LONG}, grpc.StatusCode.INVALID_ARGUMENT, "longer than 128"),
    ("job hidden", {"job": ".staging"}, grpc.StatusCode.INVALID_ARGUMENT, "reserved"),
    ("negative step", {"step": -1}, grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
    ("shard key slash", {"s0__key": "../x"}, grpc.StatusCode.INVALID_ARGUMENT, "path separator"),
    ("shard key dotdot", {"s0__key": "a..b"}, grpc.StatusCode.INVALID_ARGUMENT, "'..'"),
    ("shard key NUL", {"s0__key": "a\x00"}, grpc.StatusCode.INVALID_ARGUMENT, "NUL"),
    (
        "shard key too long",
        {"s0__key": "k" * 2000},
        grpc.StatusCode.INVALID_ARGUMENT,
        "longer than",
    ),
    ("duplicate keys", {"s1__key": "a"}, grpc.StatusCode.INVALID_ARGUMENT, "duplicate shard key"),
    (
        "offset outside lease",
        {"s1__offset": 2**40},
        grpc.StatusCode.INVALID_ARGUMENT,
        "holes or overlaps",
    ),
    (
        "length outside lease",
        {"s0__shape": [2**30], "s0__length": 2**32, "s1__offset": 2**32},
        grpc.StatusCode.INVALID_ARGUMENT,
        "acquire a lease large enough",
    ),
    ("length vs shape", {"s0__length": 12}, grpc.StatusCode.INVALID_ARGUMENT, "length 12"),
    ("overlap", {"s1__offset": 8}, grpc.StatusCode.INVALID_ARGUMENT, "holes or overlaps"),
    (
        "unaligned data offset",
        {"data_offset": 100},
        grpc.StatusCode.INVALID_ARGUMENT,
        "multiple of 4096",
    ),
    ("bad dtype", {"s0__dtype": "not-a-dtype"}, grpc.StatusCode.INVALID_ARGUMENT, "unknown dtype"),
    ("object dtype", {"s0__dtype": "|O"}, grpc.StatusCode.INVALID_ARGUMENT, "Python objects"),
    ("rank outside node ranks", {"rank": 3}, grpc.StatusCode.INVALID_ARGUMENT, "not in node_ranks"),
    (
        "bad index",
        {"s0__global_shape": [4], "s0__index": [pb.SliceSpec(start=2, stop=6)]},
        grpc.StatusCode.INVALID_ARGUMENT,
        "does not place",
    ),
    (
        "bad metadata",
        {"metadata_json": "{nope"},
        grpc.StatusCode.INVALID_ARGUMENT,
        "not valid JSON",
    ),
    ("unknown lease", {"lease_id": "no-such-lease"}, grpc.StatusCode.NOT_FOUND, "unknown lease"),
]


@pytest.mark.parametrize(
    ("name", "changes", "code", "match"), BAD_COMMITS, ids=[b[0] for b in BAD_COMMITS]
)
def test_bad_commit_is_refused_clearly(
    daemon: Daemon, name: str, changes: dict[str, Any], code: grpc.StatusCode, match: str
) -> None:
    stub = daemon.stub()
    req = mutate(good_request(stub), **changes)
    expect(code, match, stub.CommitShards, req)
    # the refused lease is still usable: the same request, fixed, commits
    fixed = good_request(stub, step=99)
    stub.CommitShards(fixed, metadata=META)
    still_serving(daemon)


def test_second_commit_of_same_step_and_rank_conflicts(make_daemon: Any) -> None:
    # The first commit's write is held, so the second surely comes while it is in
    # flight (a fast write could otherwise be LOCAL first: then it is a new save).
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=pause"})
    stub = daemon.stub()
    stub.CommitShards(good_request(stub, step=5), metadata=META)
    daemon.wait_failpoint("write.begin")
    expect(grpc.StatusCode.ALREADY_EXISTS, "already", stub.CommitShards, good_request(stub, step=5))
    daemon.release("write.begin")
    SaveHandle(daemon.client("errs"), 5).wait("local", timeout=30)
    # Once committed, a save under the same number is a new save: it begins a new
    # timeline and replaces the step (never an error, never silently dropped).
    stub.CommitShards(good_request(stub, step=5), metadata=META)
    SaveHandle(daemon.client("errs"), 5).wait("local", timeout=30)
    assert [e.step for e in daemon.events_of(pb.STEP_EVENT_REPLACED, "errs")] == [5]
    timeline = daemon.events_of(pb.STEP_EVENT_TIMELINE, "errs")
    assert [(e.step, dict(e.attributes)["timeline"]) for e in timeline] == [(5, "1")]
    reused = good_request(stub, step=6)
    stub.CommitShards(reused, metadata=META)
    with pytest.raises(grpc.RpcError) as info:  # still being written, or already back in the pool
        stub.CommitShards(mutate(reused, step=7), metadata=META)
    assert info.value.code() in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND)
    SaveHandle(daemon.client("errs"), 6).wait("local", timeout=30)
    # once written, the lease is back in the pool and its id is dead
    expect(grpc.StatusCode.NOT_FOUND, "unknown lease", stub.CommitShards, mutate(reused, step=7))
    still_serving(daemon)


def test_lease_from_another_job_and_over_budget(daemon: Daemon) -> None:
    stub = daemon.stub()
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "was granted to job",
        stub.CommitShards,
        mutate(good_request(stub, job="one"), job="two"),
    )
    expect(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "raise staging_budget_bytes",
        stub.AcquireLease,
        pb.AcquireLeaseRequest(job="big", size_bytes=2**40),
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "path separator",
        stub.AcquireLease,
        pb.AcquireLeaseRequest(job="a/b", size_bytes=10),
    )
    still_serving(daemon)


def test_restore_of_missing_step_and_bad_wait(daemon: Daemon) -> None:
    stub = daemon.stub()
    expect(
        grpc.StatusCode.NOT_FOUND,
        "no save of step 42",
        stub.Restore,
        pb.RestoreRequest(job="j", step=42),
    )
    expect(
        grpc.StatusCode.NOT_FOUND,
        "no restorable checkpoint",
        stub.Restore,
        pb.RestoreRequest(job="j"),
    )
    expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        "no remote tier",
        stub.GetSaveStatus,
        pb.GetSaveStatusRequest(job="alive", step=0, wait_for=pb.SAVE_STATE_DURABLE),
    )
    with pytest.raises(CheckpointNotFound, match="no save of step 42"):
        daemon.client("j").restore(step=42)
    still_serving(daemon)


@pytest.mark.parametrize("metadata", [(), ((PROTOCOL_HEADER, "0"),), ((PROTOCOL_HEADER, "2"),)])
def test_incompatible_protocol_version_is_refused(daemon: Daemon, metadata: Any) -> None:
    stub = daemon.stub()
    details = expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        "protocol",
        stub.GetStatus,
        pb.GetStatusRequest(),
        metadata=metadata,
    )
    assert "install matching ckptd versions" in details or "sent no" in details
    still_serving(daemon)


def test_client_side_errors_are_clear(daemon: Daemon) -> None:
    client = daemon.client("clientside")
    with pytest.raises(TypeError, match="has type object"):
        client.save(1, {"bad": object()})
    with pytest.raises(TypeError, match="dtype object"):
        client.save(1, {"bad": np.array([1, "a"], dtype=object)})
    with pytest.raises(ValueError, match="non-negative int"):
        client.save(-1, {"x": np.arange(2)})
    with pytest.raises(TypeError, match="JSON-serialisable"):
        client.save(1, {"x": np.arange(2)}, metadata={"when": object()})
    with pytest.raises(ValueError, match="stage must be one of"):
        client.save(1, {"x": np.arange(2)}).wait("someday")
    with pytest.raises(CkptdError, match="no remote tier"):
        client.save(2, {"x": np.arange(2)}).wait("durable", timeout=5)
    still_serving(daemon)


def test_unreachable_daemon_says_what_to_do(tmp_path: Any) -> None:
    from ckptd.client import CkptdUnavailable, Client

    with pytest.raises(CkptdUnavailable, match="is `ckptd serve` running"):
        Client("j", socket=tmp_path / "nothing.sock", timeout=5).list()


def test_restore_lease_cannot_be_committed(daemon: Daemon) -> None:
    client = daemon.client("rl")
    client.save(1, {"x": np.arange(4, dtype=np.float32)}).wait("local")
    client.save(2, {"x": np.arange(4, dtype=np.float32)}).wait("local")
    stub = daemon.stub()
    resp = stub.Restore(pb.RestoreRequest(job="rl", shared_memory=True), metadata=META)
    assert resp.HasField("lease")
    req = good_request(stub, job="rl", step=3)
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "holds restored data",
        stub.CommitShards,
        mutate(req, lease_id=resp.lease.lease_id),
    )
    still_serving(daemon)


def test_a_call_without_a_live_session_is_refused(daemon: Daemon) -> None:
    from ckptd.core.session import SESSION_HEADER
    from ckptd.core.wire import CHANNEL_OPTIONS
    from ckptd.proto import ckptd_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(f"unix:{daemon.socket}", options=CHANNEL_OPTIONS)
    bare = pb_grpc.CkptdStub(channel)
    for metadata in (META, (*META, (SESSION_HEADER, "forged-token"))):
        with pytest.raises(grpc.RpcError) as info:
            bare.GetStatus(pb.GetStatusRequest(), metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "session" in (info.value.details() or "")
    channel.close()
    daemon.stub().GetStatus(pb.GetStatusRequest(), metadata=META)  # with one: served


def test_the_session_socket_refuses_requests_it_does_not_know(daemon: Daemon) -> None:
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(daemon.socket) + ".session")
    f = sock.makefile("rwb")
    hello = json.loads(f.readline())
    assert hello["uid"] == os.geteuid() and hello["session"]
    for line in (
        b"not json\n",
        b'{"op": "rm -rf"}\n',
        b'{"op": "lease", "lease_id": "nope"}\n',
        b'{"op": "file", "path": "/etc/shadow"}\n',
    ):
        f.write(line)
        f.flush()
        answer = json.loads(f.readline())
        assert answer["error"] in ("INVALID_ARGUMENT", "NOT_FOUND", "PERMISSION_DENIED"), answer
        assert answer["message"]
    sock.close()
    daemon.stub().GetStatus(pb.GetStatusRequest(), metadata=META)  # still serving
