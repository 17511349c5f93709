"""Metrics and health endpoints of a real daemon (issue 16): what a scrape shows after
saves, restores and a paused drain; /healthz, /readyz and the gRPC health service;
clear errors for a bad or taken address. Synchronised on the daemon's status,
events and failpoints, never on sleeps."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ckptd.client.handle import SaveHandle
from ckptd.daemon.app import config
from ckptd.daemon.app.http import parse_address

from .conftest import CKPTD, Daemon


def scrape(daemon: Daemon) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(daemon.metrics_url(), timeout=30) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def get(daemon: Daemon, path: str, method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(daemon.metrics_url(path), method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_scrape_counts_saves_bytes_latency_and_restores(daemon: Daemon) -> None:
    client = daemon.client("scraped")
    before_save = time.time()
    client.save(1, {"w": np.ones(4096, np.float32)}).wait("local")
    after_save = time.time()
    tree, _ = client.restore()
    del tree
    t0 = time.time()
    m = scrape(daemon)
    t1 = time.time()
    assert value(m, "ckptd_saves_total", result="local") == 1
    assert value(m, "ckptd_bytes_total", stage="local") > 4096 * 4
    assert value(m, "ckptd_handoff_to_local_seconds_count") == 1
    # The trainer's restore of the step it just saved: from the memory tier.
    assert value(m, "ckptd_restores_total", tier="memory") == 1
    assert value(m, "ckptd_restores_total", tier="local") == 0
    assert value(m, "ckptd_tier_steps", tier="local") == 1
    assert value(m, "ckptd_tier_steps", tier="memory") == 1
    assert value(m, "ckptd_tier_bytes", tier="memory") > 4096 * 4
    assert value(m, "ckptd_exposure_seconds", job="scraped", tier="memory") >= 0
    assert value(m, "ckptd_local_free_bytes") > 0
    exposure = value(m, "ckptd_exposure_seconds", job="scraped", tier="local")
    # Now minus the step's handoff: between these bounds, whatever the machine's load.
    assert t0 - after_save <= exposure <= t1 - before_save
    # A newer step lands: the exposure follows it, not the first step.
    before_second = time.time()
    client.save(2, {"w": np.zeros(4096, np.float32)}).wait("local")
    m2 = scrape(daemon)
    t2 = time.time()
    assert value(m2, "ckptd_exposure_seconds", job="scraped", tier="local") <= t2 - before_second
    assert value(m2, "ckptd_saves_total", result="local") == 2


def test_exposure_of_the_bucket_grows_while_the_drain_is_stopped(
    make_daemon: Any, tmp_path: Path
) -> None:
    url = f"file://{tmp_path / 'bucket'}"
    daemon: Daemon = make_daemon(
        env={"CKPTD_FAILPOINTS": "drain.upload=pause"}, extra_args=["--remote", url]
    )
    client = daemon.client("drained")
    client.save(1, {"w": np.ones(64)}).wait("local")
    daemon.wait_failpoint("drain.upload")  # step 1 stays out of the bucket
    m1 = scrape(daemon)
    assert ("ckptd_exposure_seconds", (("job", "drained"), ("tier", "remote"))) not in m1
    assert value(m1, "ckptd_drain_lag_seconds") > 0
    lag1 = value(m1, "ckptd_drain_lag_seconds")
    m2 = scrape(daemon)
    assert value(m2, "ckptd_drain_lag_seconds") >= lag1  # grows while stopped
    daemon.release("drain.upload")
    SaveHandle(client, 1).wait("durable", timeout=120)
    m3 = scrape(daemon)
    assert value(m3, "ckptd_saves_total", result="durable") == 1
    assert value(m3, "ckptd_handoff_to_durable_seconds_count") == 1
    assert value(m3, "ckptd_drain_lag_seconds") == 0
    remote = value(m3, "ckptd_exposure_seconds", job="drained", tier="remote")
    m4 = scrape(daemon)
    assert value(m4, "ckptd_exposure_seconds", job="drained", tier="remote") >= remote


def test_health_endpoints_and_grpc_health(daemon: Daemon) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert get(daemon, "/healthz") == (200, "ok\n")
    assert get(daemon, "/readyz") == (200, "ready\n")
    assert get(daemon, "/nope")[0] == 404
    assert get(daemon, "/metrics", method="POST")[0] == 405
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "ckptd.v1.Ckptd"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # Garbage on the port is a 400, and the daemon goes on serving.
    host, port = daemon.status().metrics_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"\x00" * 9000 + b"\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 400")
    assert get(daemon, "/healthz")[0] == 200


def test_metrics_address_is_checked_and_a_taken_one_is_a_clear_error(
    make_daemon: Any, tmp_path: Path
) -> None:
    assert parse_address("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_address("[::1]:0") == ("::1", 0)
    assert parse_address("off") is None
    with pytest.raises(config.ConfigError, match=r"metrics_address.*HOST:PORT"):
        config.load(env={}, flags={"metrics_address": "localhost"})
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = f"127.0.0.1:{held.getsockname()[1]}"
        out = subprocess.run(
            [
                *(CKPTD, "serve", "--root", str(tmp_path / "r")),
                *("--socket", str(tmp_path / "s.sock"), "--metrics-address", taken),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode != 0
    assert f"cannot serve metrics on {taken}" in out.stderr and "Traceback" not in out.stderr
    # "off" serves none; the status says so.
    quiet: Daemon = make_daemon(extra_args=["--metrics-address", "off"])
    assert quiet.status().metrics_address == ""


def test_a_typo_in_the_job_name_gets_a_suggestion(daemon: Daemon) -> None:
    from ckptd.client import CheckpointNotFound

    daemon.client("llama-70b").save(1, {"w": np.ones(4)}).wait("local")
    with pytest.raises(CheckpointNotFound, match=r"did you mean 'llama-70b'\?"):
        daemon.client("llama-7b").restore()
    with pytest.raises(CheckpointNotFound, match="start from scratch"):
        daemon.client("unrelated").restore()
