"""Unit tests of the drain's pure parts: backoff, error classes, marker keys."""

from __future__ import annotations

import errno

import pytest

from ckptd.daemon.drain import Backoff
from ckptd.daemon.layout import marker_key, parse_marker
from ckptd.daemon.remote import RemoteError, is_transient


def test_backoff_is_exponential_capped_and_jittered() -> None:
    top = Backoff(0.5, 8.0, rand=lambda: 1.0)
    assert [top.delay(a) for a in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    bottom = Backoff(0.5, 8.0, rand=lambda: 0.0)
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
        (FileNotFoundError("no bucket"), False),
        (PermissionError("denied"), False),
        (RemoteError("crc mismatch", transient=True), True),
        (RemoteError("file ended early", transient=False), False),
        (ValueError("bad"), False),
    ],
)
def test_error_classification(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


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
    assert parse_marker("run-1/40/_complete/node-a") == ("run-1", 40, "node-a")
    assert parse_marker("run-1/40/node-a/manifest.json") is None
    assert parse_marker("run-1/x/_complete/node-a") is None
