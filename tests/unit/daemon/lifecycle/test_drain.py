"""Unit tests of the drain's pure parts: backoff, error classes, marker keys."""

from __future__ import annotations

import errno
from collections import Counter

import pytest

from ckptd.core.errors import InvalidArgument
from ckptd.core.manifest import DATA_BY_STEP, DATA_SPREAD, DATA_TIMELINE
from ckptd.daemon.remote.base import RemoteError
from ckptd.daemon.remote.file import FileRemote
from ckptd.daemon.remote.gcs import GCSRemote
from ckptd.daemon.remote.layout import (
    DATA_DIR,
    data_prefix,
    file_key,
    manifest_key,
    marker_key,
    parse_marker,
    parse_step_name,
    pin_key,
    spread,
    upload_order,
)
from ckptd.daemon.remote.s3 import S3Remote
from ckptd.daemon.retry import Backoff


def is_transient(exc: BaseException, backend: type = S3Remote) -> bool:
    """Each backend classifies its own errors; the filesystem is not needed for that."""
    remote = backend.__new__(backend)
    return bool(remote.is_transient(exc))


def test_backoff_is_exponential_capped_and_jittered() -> None:
    top = Backoff(0.5, 8.0, jitter=True, rand=lambda: 1.0)
    assert [top.delay(a) for a in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    bottom = Backoff(0.5, 8.0, jitter=True, rand=lambda: 0.0)
    assert bottom.delay(3) == 0.0  # full jitter: anywhere in [0, cap]


class _ClientError(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}}


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (ConnectionRefusedError(), True),
        (TimeoutError(), True),
        (OSError(errno.EREMOTEIO, "We encountered an internal error"), True),
        (_ClientError("SlowDown"), True),
        (_ClientError("InternalError"), True),
        (_ClientError("AccessDenied"), False),
        (type("HTTPClientError", (Exception,), {})("unparsable reply"), True),
        (FileNotFoundError("no bucket"), False),
        (PermissionError("denied"), False),
        (RemoteError("crc mismatch", transient=True), True),
        (RemoteError("file ended early", transient=False), False),
        (ValueError("bad"), False),
    ],
)
def test_error_classification(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


class _HttpError(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"HTTP {code}")
        self.code = code


def test_each_backend_knows_its_own_codes() -> None:
    assert is_transient(_HttpError(503), GCSRemote)
    assert is_transient(_HttpError(429), GCSRemote)
    assert not is_transient(_HttpError(403), GCSRemote)
    assert not is_transient(_ClientError("SlowDown"), FileRemote)  # not an S3 error there
    assert is_transient(ConnectionResetError(), FileRemote)


def test_wrapped_transient_cause_is_transient() -> None:
    try:
        try:
            raise ConnectionResetError()
        except ConnectionResetError as inner:
            raise OSError(errno.EINVAL, "wrapped") from inner
    except OSError as outer:
        assert is_transient(outer)


def test_marker_keys_round_trip() -> None:
    assert marker_key("run-1", 40, "node-a") == "run-1/40/_complete/node-a"
    assert parse_marker("run-1/40/_complete/node-a") == ("run-1", 40, "node-a", False)
    assert parse_marker("run-1/40/node-a/manifest.json") is None
    assert parse_marker("run-1/x/_complete/node-a") is None
    assert parse_marker("run-1/x.ckptd/_complete/node-a") is None
    assert parse_marker("run-1/40.tmp/_complete/node-a") is None


def test_adopted_keys_keep_the_tree_where_orbax_reads_it() -> None:
    # An adopted (Orbax) step: the tree at <job>/<step>/, ckptd's records beside it.
    assert marker_key("j", 7, "n", adopted=True) == "j/7.ckptd/_complete/n"
    assert parse_marker("j/7.ckptd/_complete/n") == ("j", 7, "n", True)
    assert manifest_key("j", 7, "n", adopted=True) == "j/7.ckptd/n/manifest.json"
    assert manifest_key("j", 7, "n") == "j/7/n/manifest.json"
    assert file_key("j", 7, "n", "files/default/_METADATA", adopted=True) == "j/7/default/_METADATA"
    assert file_key("j", 7, "n", "rank-00000.safetensors") == "j/7/n/rank-00000.safetensors"
    assert pin_key("j", 7, adopted=True) == "j/7.ckptd/_pinned"


def test_rank_files_spread_by_node_in_ranges_that_do_not_move_with_the_step() -> None:
    # Layout 2: <job>/_data/<hh>/<node>/<step>/; layout 1 (older buckets): beside the
    # manifest. The manifest records only the layout's number, so <hh> must never change
    # for a name: these values are pinned.
    assert spread("test-node") == "6c" and spread("node-0") == "fd"
    assert file_key("j", 7, "test-node", "rank-00000.safetensors", layout=DATA_SPREAD) == (
        "j/_data/6c/test-node/7/rank-00000.safetensors"
    )
    assert data_prefix("j", 8, "test-node", DATA_SPREAD) == "j/_data/6c/test-node/8"
    assert data_prefix("j", 8, "test-node", DATA_BY_STEP) == "j/8/test-node"
    # Spread evenly: 10,000 node names over the 256 ranges, none more than twice its share.
    counts = Counter(spread(f"node-{i}") for i in range(10_000))
    assert len(counts) == 256 and max(counts.values()) < 2 * 10_000 / 256
    assert parse_step_name(DATA_DIR) == (None, False)  # never taken for a step
    # Layout 3: each step's files under its number and timeline (two saves under one
    # number, of two timelines, never share a key: daemon/remote/held.py).
    assert data_prefix("j", 8, "test-node", DATA_TIMELINE, 2) == "j/_data/6c/test-node/8.2"
    assert file_key("j", 8, "test-node", "r", layout=DATA_TIMELINE) == "j/_data/6c/test-node/8.0/r"
    with pytest.raises(InvalidArgument, match="data_layout"):
        data_prefix("j", 8, "n", 4)


def test_adopted_upload_order_puts_commit_success_last() -> None:
    files = [
        "files/_CHECKPOINT_METADATA",
        "files/commit_success.txt",
        "files/default/commit_success.txt",
        "files/default/_METADATA",
        "files/default/d/abc",
    ]
    waves = upload_order(files)
    assert waves == [
        ["files/_CHECKPOINT_METADATA", "files/default/_METADATA", "files/default/d/abc"],
        ["files/default/commit_success.txt"],
        ["files/commit_success.txt"],
    ]
    # A tree without Orbax's commit files (a DCP directory): one wave.
    assert upload_order(["files/a", "files/b/c"]) == [["files/a", "files/b/c"]]
