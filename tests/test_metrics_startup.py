"""The daemon's status and /metrics are correct from the first request: every service
is built before anything serves (app/compose.py), so nothing they read is missing
while the daemon still recovers and replays its journal."""

from __future__ import annotations

import asyncio
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from ckptd.daemon import __version__
from ckptd.daemon.app.compose import Daemon as Services
from ckptd.daemon.app.config import Config
from ckptd.daemon.app.launcher import event_is
from ckptd.proto import ckptd_pb2 as pb

from .conftest import Daemon

MiB = 2**20


def _free_port() -> int:
    """A port free now (the daemon binds it at once; the kernel does not hand a port
    just released to the next bind(0) of another process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_and_probes_answer_while_the_journal_replays(make_daemon: Any) -> None:
    # One acknowledged handoff the daemon dies before writing: the next start replays it.
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=pause"})
    daemon.client("replayed").save(1, {"w": np.ones(2**16, np.float32)})
    daemon.wait_failpoint("write.begin")
    daemon.kill()
    # The next daemon holds its start-up in the replay; its HTTP endpoint already serves.
    address = f"127.0.0.1:{_free_port()}"
    daemon.env = {"CKPTD_FAILPOINTS": "journal.replay=pause"}
    daemon.extra_args += ["--metrics-address", address]
    daemon.start(wait=False)
    try:
        daemon.wait_failpoint("journal.replay")
        code, text = _get(f"http://{address}/metrics")
        assert code == 200, text
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert samples[("ckptd_build_info", (("version", __version__),))] == 1
        # While it recovers only counters are shown, and no save has ended yet.
        assert all(v == 0 for (name, _), v in samples.items() if name == "ckptd_saves_total")
        assert not any(name == "ckptd_exposure_seconds" for name, _ in samples)
        assert _get(f"http://{address}/healthz") == (200, "ok\n")
        code, text = _get(f"http://{address}/readyz")
        assert code == 503 and "starting" in text
    finally:
        daemon.release("journal.replay")
    daemon.wait_ready()
    daemon.wait_event(event_is(pb.STEP_EVENT_LOCAL, 1), job="replayed")
    status = daemon.status()
    assert status.metrics_address == address and status.checkpoints == 1
    assert _get(f"http://{address}/readyz")[0] == 200


def test_status_is_whole_before_start(tmp_path: Path) -> None:
    """Built, not started (nothing recovered yet): the status reads every service."""
    root = tmp_path / "root"
    root.mkdir()
    config = Config(
        root=root, socket=tmp_path / "s.sock", node_id="n1", staging_budget_bytes=64 * MiB
    )

    async def built() -> pb.DaemonStatus:
        services = Services(config, lambda reason: None)
        try:
            return services.status()
        finally:
            services.io.close()
            services.evict_io.close()

    status = asyncio.run(built())
    assert status.node_id == "n1" and status.staging_budget_bytes == 64 * MiB
    assert status.checkpoints == 0 and status.drain_queue == 0 and status.jobs == 0
    assert status.retention_local and status.retention_remote == ""
    assert status.tasks == [] and status.adopted == 0
