"""The bucket misbehaving: refused, reset, 5xx, frozen, slow, denied; a full local disk.

The S3 store (a real SeaweedFS) is reached through a fault-injecting TCP proxy
(proxy.py) the test switches between modes while the daemon runs. Every case
ends with the store healthy again, the step DURABLE, and the shared invariants.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client import CkptdError, SaveFailed
from ckptd.client.handle import SaveHandle
from ckptd.proto import ckptd_pb2 as pb

from ..conftest import Daemon
from ..helpers import own_tmpfs, state_for
from .invariants import Ledger, check_all
from .proxy import FaultProxy

FAST = ["--drain-retry-max-seconds", "1", "--drain-stall-seconds", "2"]


@pytest.fixture
def s3_via_proxy(s3_server: Any) -> Iterator[tuple[FaultProxy, str, dict[str, str]]]:
    """A fresh bucket on the session's SeaweedFS, reached through a proxy."""
    bucket = s3_server.make_bucket(f"ckptd-faults-{os.getpid()}-{secrets.token_hex(4)}")
    with FaultProxy(("127.0.0.1", s3_server.s3_port)) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL_S3": proxy.url, "AWS_ENDPOINT_URL": proxy.url}
        yield proxy, f"s3://{bucket}/ckpt", env


def _event(daemon: Daemon, kind: int, step: int, after: int = 0) -> pb.EventRecord:
    return daemon.wait_event(lambda e: e.kind == kind and e.step == step, after=after)


OUTAGES = {
    "refused": ("refuse", {}),
    "reset": ("reset", {}),
    "503": ("http_error", {"status": 503}),
}


@pytest.mark.parametrize(
    "outage",
    [pytest.param("503", id="503"), *(pytest.param(o, marks=pytest.mark.faults) for o in OUTAGES)],
)
def test_upload_retries_through_an_outage(
    make_daemon: Any, s3_via_proxy: tuple[FaultProxy, str, dict[str, str]], outage: str
) -> None:
    proxy, url, env = s3_via_proxy
    daemon: Daemon = make_daemon(env=env, extra_args=["--remote", url, *FAST])
    client = daemon.client("outage")
    ledger = Ledger("outage", lambda s: state_for(s, 2))
    mode, params = OUTAGES[outage]
    proxy.set_mode(mode, **params)  # type: ignore[arg-type]
    ledger.save(client, 1).wait("local")
    retrying = _event(daemon, pb.STEP_EVENT_RETRYING, 1)
    assert "upload" in retrying.detail
    assert daemon.status().drain_error  # an operator sees it
    proxy.set_mode("pass")
    SaveHandle(client, 1).wait("durable", timeout=120)
    assert daemon.status().drain_error == ""
    check_all(daemon, client, ledger, remote_url=url, env=env)


def test_a_hung_store_shows_as_a_drain_error(
    make_daemon: Any, s3_via_proxy: tuple[FaultProxy, str, dict[str, str]]
) -> None:
    proxy, url, env = s3_via_proxy
    daemon: Daemon = make_daemon(env=env, extra_args=["--remote", url, *FAST])
    client = daemon.client("hung")
    ledger = Ledger("hung", lambda s: state_for(s, 2))
    proxy.set_mode("freeze")  # connections accepted, never answered, no error
    ledger.save(client, 1).wait("local")
    stalled = _event(daemon, pb.STEP_EVENT_RETRYING, 1)
    assert "not answering" in stalled.detail
    assert "not answering" in daemon.status().drain_error
    assert client.list()[0].state == "DRAINING"
    proxy.set_mode("pass")  # frozen connections are reset; the upload goes on
    SaveHandle(client, 1).wait("durable", timeout=180)
    check_all(daemon, client, ledger, remote_url=url, env=env)


def test_a_denied_upload_fails_keeps_the_local_copy_and_retries_later(
    make_daemon: Any, s3_via_proxy: tuple[FaultProxy, str, dict[str, str]]
) -> None:
    proxy, url, env = s3_via_proxy
    daemon: Daemon = make_daemon(env=env, extra_args=["--remote", url, *FAST])
    client = daemon.client("denied")
    ledger = Ledger("denied", lambda s: state_for(s, 2))
    proxy.set_mode("http_error", status=403)  # permanent as far as the store says
    ledger.save(client, 1).wait("local")
    failed = _event(daemon, pb.STEP_EVENT_FAILED, 1)
    assert "stays restorable" in failed.detail
    # The event says what the catalog held then (the retry may have begun since).
    assert failed.state == pb.SAVE_STATE_FAILED and list(failed.tiers) == [pb.TIER_LOCAL]
    tree, meta = client.restore()  # the local copy is still served
    assert meta == {"step": 1}
    del tree
    proxy.set_mode("pass")
    seq = failed.seq
    _event(daemon, pb.STEP_EVENT_REQUEUED, 1, after=seq)
    SaveHandle(client, 1).wait("durable", timeout=120)
    check_all(daemon, client, ledger, remote_url=url, env=env)


@pytest.mark.faults
def test_slow_store_still_completes(
    make_daemon: Any, s3_via_proxy: tuple[FaultProxy, str, dict[str, str]]
) -> None:
    proxy, url, env = s3_via_proxy
    daemon: Daemon = make_daemon(env=env, extra_args=["--remote", url, *FAST])
    client = daemon.client("slow")
    ledger = Ledger("slow", lambda s: state_for(s, 2))
    proxy.set_mode("slow", bytes_per_second=4 * 2**20)
    ledger.save(client, 1).wait("durable", timeout=180)
    proxy.set_mode("pass")
    check_all(daemon, client, ledger, remote_url=url, env=env)


@pytest.mark.faults
def test_store_killed_and_restarted(make_daemon: Any, tmp_path: Path) -> None:
    from ..servers import SeaweedS3

    with SeaweedS3(tmp_path / "seaweed") as store:
        bucket = store.make_bucket("killed")
        url, env = f"s3://{bucket}/ckpt", store.env()
        daemon: Daemon = make_daemon(env=env, extra_args=["--remote", url, *FAST])
        client = daemon.client("killed")
        ledger = Ledger("killed", lambda s: state_for(s, 2))
        store.kill()
        ledger.save(client, 1).wait("local")
        _event(daemon, pb.STEP_EVENT_RETRYING, 1)
        store.restart()
        SaveHandle(client, 1).wait("durable", timeout=180)
        check_all(daemon, client, ledger, remote_url=url, env=env)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB tmpfs of the test's own (never the shared disk's free space)."""
    with own_tmpfs(tmp_path / "small", "48m") as mount:
        yield mount


def test_a_full_disk_fails_saves_cleanly_and_recovers(make_daemon: Any, small_disk: Path) -> None:
    daemon: Daemon = make_daemon(
        root=small_disk / "root",
        extra_args=[
            "--local-floor",
            "0",
            "--local-low-watermark",
            "0",
            "--retention-local",
            "KeepLatest(100)",
        ],
    )
    client = daemon.client("full")
    ledger = Ledger("full", lambda s: state_for(s, 8))
    failure = ""
    for step in range(1, 12):  # 32 MiB per step: the third cannot fit
        try:
            ledger.save(client, step).wait("local", timeout=60)
        except (SaveFailed, CkptdError) as exc:
            failure = str(exc)
            break
    assert "No space left" in failure or "space" in failure, failure
    outcome = check_all(daemon, client, ledger)
    assert any(o.startswith("FAILED") for o in outcome.values()) or len(outcome) < step
    # Space comes back (an operator deletes the old step): saves work again.
    client.save(100, {"x": np.arange(10)}).wait("local")
