"""Client mistakes and full disks the fuzzer found get clean statuses, never INTERNAL.

Each case once answered INTERNAL (a ValueError, RecursionError or OSError escaping
to the servicer); now each is refused with a status and a message that says what to do.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.core.errors import CkptdError, from_os_error
from ckptd.core.names import MAX_JOB_BYTES, check_path, check_wait
from ckptd.core.wire import Connection
from ckptd.daemon.adopt.tree import finished_steps
from ckptd.proto import ckptd_pb2 as pb

from .conftest import Daemon
from .helpers import own_tmpfs


def call(d: Daemon, method: str, request: Any) -> tuple[str, str]:
    """``(status name, message)`` of one call ("OK", "" on success)."""
    with Connection(d.socket, timeout=30) as conn:
        try:
            conn.call_by_name(method, request)
        except CkptdError as exc:
            return exc.code, str(exc)
    return "OK", ""


def commit_request(d: Daemon, job: str, step: int, **fields: Any) -> pb.CommitShardsRequest:
    """A valid one-shard commit on a fresh lease, with ``fields`` changed."""
    with Connection(d.socket) as conn:
        lease = conn.acquire_lease(pb.AcquireLeaseRequest(job=job, size_bytes=4096))
    shard = pb.ShardDescriptor(key="a", dtype="<f4", shape=[4], offset=0, length=16)
    return pb.CommitShardsRequest(
        lease_id=lease.lease_id, job=job, step=step, shards=[shard], **fields
    )


def test_longest_job_name_saves_drains_and_restores(make_daemon: Any, tmp_path: Path) -> None:
    """Every file name derived from a job name of the maximum length fits in 255 bytes."""
    d = make_daemon(extra_args=["--remote", f"file://{tmp_path}/bucket"])
    job = "j" * MAX_JOB_BYTES
    client = d.client(job)
    client.save(1, {"x": np.arange(5)}).wait("durable", timeout=60)
    tree, _ = client.restore()
    assert tree["x"].tolist() == list(range(5))
    code, message = call(d, "AcquireLease", pb.AcquireLeaseRequest(job=job + "j", size_bytes=1))
    assert code == "INVALID_ARGUMENT" and f"longer than {MAX_JOB_BYTES} bytes" in message


@pytest.mark.parametrize("bad", [math.nan, -1.0, -math.inf])
def test_bad_waits_are_refused(daemon: Daemon, bad: float) -> None:
    """NaN and negative waits are refused, naming the field and the accepted range."""
    daemon.client("w").save(1, {"x": np.arange(3)}).wait("local", timeout=30)
    req = pb.GetSaveStatusRequest(
        job="w", step=1, wait_for=pb.SAVE_STATE_LOCAL, timeout_seconds=bad
    )
    code, message = call(daemon, "GetSaveStatus", req)
    assert code == "INVALID_ARGUMENT" and "timeout_seconds" in message and "3600" in message
    lease_req = pb.AcquireLeaseRequest(job="w", size_bytes=1, wait_seconds=bad)
    code, message = call(daemon, "AcquireLease", lease_req)
    assert code == "INVALID_ARGUMENT" and "wait_seconds" in message


def test_infinite_wait_is_capped(daemon: Daemon) -> None:
    """An infinite wait is the documented bound: a reached stage answers at once."""
    daemon.client("w").save(1, {"x": np.arange(3)}).wait("local", timeout=30)
    req = pb.GetSaveStatusRequest(
        job="w", step=1, wait_for=pb.SAVE_STATE_LOCAL, timeout_seconds=math.inf
    )
    assert call(daemon, "GetSaveStatus", req) == ("OK", "")


def test_unknown_wait_stage_is_refused(daemon: Daemon) -> None:
    daemon.client("w").save(1, {"x": np.arange(3)}).wait("local", timeout=30)
    req = pb.GetSaveStatusRequest(job="w", step=1, wait_for=99, timeout_seconds=0.1)  # type: ignore[arg-type]
    code, message = call(daemon, "GetSaveStatus", req)
    assert code == "INVALID_ARGUMENT" and "UNKNOWN(99)" in message and "LOCAL" in message


@pytest.mark.parametrize("field", ["metadata_json", "tree_json"])
@pytest.mark.parametrize("depth", [300, 100_000])
def test_deeply_nested_json_is_refused(daemon: Daemon, field: str, depth: int) -> None:
    """Past the parser's recursion limit (100,000) or the daemon's bound (300)."""
    deep = '{"a":' * depth + "1" + "}" * depth
    code, message = call(daemon, "CommitShards", commit_request(daemon, "deep", 1, **{field: deep}))
    assert code == "INVALID_ARGUMENT" and f"{field} nests deeper than" in message
    fine = json.dumps({"a": {"b": [1, 2, {"c": None}]}})
    req = commit_request(daemon, "deep", 2, **{field: fine})
    assert call(daemon, "CommitShards", req) == ("OK", "")


@pytest.mark.parametrize("field", ["metadata_json", "tree_json"])
def test_an_integer_too_long_to_convert_is_refused(daemon: Daemon, field: str) -> None:
    """Python refuses to parse integers of more than 4,300 digits (a ValueError that is
    not a JSONDecodeError): the caller is told, the daemon does not call it internal."""
    huge = json.dumps({"n": 0}).replace("0", "9" * 5000)
    code, message = call(daemon, "CommitShards", commit_request(daemon, "huge", 1, **{field: huge}))
    assert code == "INVALID_ARGUMENT" and f"{field} is not valid JSON" in message


def test_deeply_nested_dtype_is_refused(daemon: Daemon) -> None:
    req = commit_request(daemon, "deep", 1)
    req.shards[0].dtype = "descr:" + "[" * 100_000 + "]" * 100_000
    code, message = call(daemon, "CommitShards", req)
    assert code == "INVALID_ARGUMENT" and "unknown dtype" in message


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs (root only), unmounted after the daemon on it stopped."""
    with own_tmpfs(tmp_path / "tmpfs", "16m") as mnt:
        yield mnt


def fill(path: Path) -> None:
    """Write zeros into ``path`` until the filesystem is full."""
    with open(path, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()


def test_pin_on_a_full_disk(small_tmpfs: Path, make_daemon: Any) -> None:
    """RESOURCE_EXHAUSTED saying to free space; the pin is not half-recorded; then it works."""
    root = small_tmpfs / "root"
    d = make_daemon(root=root, extra_args=["--local-floor", "0%", "--local-low-watermark", "0%"])
    d.client("p").save(1, {"x": np.arange(3)}).wait("local", timeout=30)
    filler = small_tmpfs / "filler"
    fill(filler)
    code, message = call(d, "Pin", pb.PinRequest(job="p", step=1, pinned=True))
    assert code == "RESOURCE_EXHAUSTED" and "free space" in message, message
    listed = Connection(d.socket).list_checkpoints(pb.ListCheckpointsRequest(job="p"))
    assert not listed.checkpoints[0].pinned
    assert not list(root.glob(".pins.json*")), "a partial pins file was left behind"
    filler.unlink()
    assert call(d, "Pin", pb.PinRequest(job="p", step=1, pinned=True)) == ("OK", "")
    assert json.loads((root / ".pins.json").read_text()) == {"p": [1]}


def test_check_path_and_check_wait() -> None:
    """The validators the servicer calls on client paths and waits."""
    assert check_path("directory", "", optional=True) == ""
    assert check_path("path", "/a/b") == "/a/b"
    for bad, words in [
        ("", "no path given"),
        ("rel/x", "not an absolute path"),
        ("/a\x00b", "NUL"),
        ("/" + "x" * 256, "more than 255 bytes"),
        ("/x" * 2100, "at most 4095 bytes"),
    ]:
        with pytest.raises(CkptdError, match=words) as info:
            check_path("path", bad)
        assert info.value.code == "INVALID_ARGUMENT"
    assert check_wait("w", math.inf, 3600.0) == 3600.0
    assert check_wait("w", 0.0, 3600.0) == 0.0
    with pytest.raises(CkptdError, match="w is nan"):
        check_wait("w", math.nan, 3600.0)


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (errno.ENOSPC, "RESOURCE_EXHAUSTED"),
        (errno.EDQUOT, "RESOURCE_EXHAUSTED"),
        (errno.EACCES, "PERMISSION_DENIED"),
        (errno.ENOENT, "NOT_FOUND"),
        (errno.EEXIST, "FAILED_PRECONDITION"),
        (errno.ENOTDIR, "FAILED_PRECONDITION"),
        (errno.ENAMETOOLONG, "INVALID_ARGUMENT"),
        (errno.EROFS, "FAILED_PRECONDITION"),
        (errno.EBADF, "INTERNAL"),
    ],
)
def test_os_errors_map_to_statuses(code: int, status: str) -> None:
    err = from_os_error(OSError(code, os.strerror(code)), "cannot write /x")
    assert err.code == status
    assert str(err).startswith(f"cannot write /x: {os.strerror(code)}; ")


def test_watched_directory_with_unicode_digits(tmp_path: Path) -> None:
    """'¹8'.isdigit() is true and int('¹8') raises: a watched directory holding such a
    name once failed every Watch and every scan of that job (found by the fuzzer)."""
    for name in ("¹8", "٣", "8"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "commit_success.txt").write_text("ok")
    assert [step for step, _, _ in finished_steps(tmp_path)] == [8]


def test_paths_too_long_for_the_kernel_are_refused(make_daemon: Any, tmp_path: Path) -> None:
    """A component over 255 bytes or a path over 4095 once answered INTERNAL (ENAMETOOLONG)."""
    allowed = tmp_path / "adoptable"
    allowed.mkdir()
    d = make_daemon(extra_args=["--adopt-dirs", str(allowed)])
    long_name = str(allowed / ("é" * 130))
    deep = str(allowed) + "/d" * 2100
    for method, request in [
        ("Adopt", pb.AdoptRequest(job="a", step=1, path=long_name)),
        ("Adopt", pb.AdoptRequest(job="a", step=1, path=deep)),
        ("Watch", pb.WatchRequest(job="a", directory=long_name)),
        ("Watch", pb.WatchRequest(job="a", directory=deep)),
        ("EnsureLocal", pb.EnsureLocalRequest(job="a", directory=deep)),
    ]:
        code, message = call(d, method, request)
        assert code == "INVALID_ARGUMENT" and "bytes" in message, (method, code, message)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"world_size": 2**24 + 1}, "world_size"),
        ({"rank": 2**32 - 1, "node_ranks": [2**32 - 1]}, "world_size"),
    ],
)
def test_commit_the_manifest_check_would_refuse_is_refused(
    daemon: Daemon, fields: dict[str, Any], words: str
) -> None:
    """Found by the fuzzer: a commit with world_size 22,362,545 was acknowledged, drained,
    and then refused by the manifest check when read back from the bucket (DATA_LOSS)."""
    code, message = call(daemon, "CommitShards", commit_request(daemon, "big", 1, **fields))
    assert code == "INVALID_ARGUMENT" and words in message, message


def test_dimension_of_2_62_is_refused(daemon: Daemon) -> None:
    req = commit_request(daemon, "big", 1)
    req.shards[0].global_shape[:] = [2**63]
    req.shards[0].index.add(start=0, stop=4)
    code, message = call(daemon, "CommitShards", req)
    assert code == "INVALID_ARGUMENT" and "2**62" in message, message
