"""What ``/metrics`` tells whoever reaches it, and whether its exposure alert means
something: job names only while one user saves on the node (``metrics_job_labels``),
and exposure for running jobs only (an Orbax job's adopted steps included), checked
through the alert rules with promtool on a real daemon's scrape."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from ckptd.client import Client
from ckptd.client import orbax as ckptd_orbax
from ckptd.daemon.api.liveness import LiveJobs
from ckptd.daemon.app import config
from ckptd.daemon.app.launcher import DaemonProcess
from ckptd.daemon.app.metrics import job_labels_shown

from .conftest import Daemon
from .test_deploy_observe import PROMETHEUS, promtool
from .test_metrics import scrape
from .test_security import USERS, WORKER, _python, as_user, two_user_daemon

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _exposure(samples: Samples) -> dict[tuple[tuple[str, str], ...], float]:
    """The exposure series, but the memory tier's (the local tier's, or older: no rule
    alerts on it)."""
    return {
        labels: v
        for (name, labels), v in samples.items()
        if name == "ckptd_exposure_seconds" and ("tier", "memory") not in labels
    }


def _scrape_until(daemon: DaemonProcess, done: Any, what: str) -> Samples:
    """Scrape until ``done(samples)``: the daemon notices a closed session on its loop,
    after the process is gone; the scrape is the status that says it did."""
    deadline = time.monotonic() + 60
    while True:
        samples = scrape(daemon)  # type: ignore[arg-type]
        if done(samples):
            return samples
        assert time.monotonic() < deadline, f"{what}: {sorted(_exposure(samples))}"
        time.sleep(0.05)  # a pause between polls of the status, not a wait for it


def _humanize(seconds: int) -> str:
    """Prometheus's humanizeDuration, for 1 minute to 1 hour."""
    return f"{seconds // 60}m {seconds % 60}s"


def test_exposure_is_reported_for_running_jobs_only_and_alerts_on_them(
    make_daemon: Any, tmp_path: Path
) -> None:
    daemon: Daemon = make_daemon(extra_args=["--adopt-poll-seconds", "0.05"])
    # A trainer that saved and exited: its job is finished.
    out = subprocess.run(
        [sys.executable, str(WORKER), str(daemon.socket), "save", "finished", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and '"ok": true' in out.stdout, out.stdout + out.stderr
    # A trainer that saved once and runs on (stopped saving: what the alert is for).
    running = daemon.client("running")
    running.save(1, {"w": np.ones(64, np.float32)}).wait("local")
    # An Orbax job: Orbax writes the step, the daemon adopts it from the watched directory.
    orbax = daemon.client("orbax-run")
    step = Path(ckptd_orbax.directory(orbax)) / "7"
    step.mkdir()
    (step / "data").write_bytes(b"weights")
    (step / "commit_success.txt").write_text("ok")
    deadline = time.monotonic() + 60
    while not any(c.step == 7 and "LOCAL" in c.tiers for c in orbax.list()):
        assert time.monotonic() < deadline, "the Orbax step was not adopted"
        time.sleep(0.05)  # a pause between polls of the status, not a wait for it
    samples = _scrape_until(
        daemon,
        lambda s: not any(("job", "finished") in labels for labels in _exposure(s)),
        "the finished job's exposure is still reported",
    )
    exposure = _exposure(samples)
    jobs = {dict(labels)["job"] for labels in exposure}
    assert jobs == {"running", "orbax-run"}, exposure
    # The rules, fed the scraped series as they grow while nothing saves: the running
    # and the Orbax job alert after 35 minutes, the finished one never does.
    rules = tmp_path / "rules"
    rules.mkdir()
    shutil.copy(PROMETHEUS / "ckptd-alerts.yml", rules)
    series, expected = [], []
    for labels, v in sorted(exposure.items()):
        lab = {"instance": "n1", **dict(labels)}
        text = ",".join(f'{k}="{x}"' for k, x in sorted(lab.items()))
        series.append({"series": f"ckptd_exposure_seconds{{{text}}}", "values": f"{int(v)}+60x45"})
        expected.append(
            {
                "exp_labels": {"severity": "warning", **lab},
                "exp_annotations": {
                    "summary": f"job {lab['job']}: newest local checkpoint is "
                    f"{_humanize(int(v) + 40 * 60)} old on n1",
                    "description": _rule("CkptdExposureLocalHigh")["annotations"]["description"],
                },
            }
        )
    test = {
        "rule_files": ["ckptd-alerts.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {
                        "eval_time": "40m",
                        "alertname": "CkptdExposureLocalHigh",
                        "exp_alerts": expected,
                    }
                ],
            }
        ],
    }
    (rules / "test.yml").write_text(yaml.safe_dump(test))
    out = subprocess.run(
        [promtool(), "test", "rules", "test.yml"],
        cwd=rules,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # The running trainer exits too: its job leaves the scrape (the alert resolves).
    running.close()
    _scrape_until(
        daemon,
        lambda s: {dict(lab)["job"] for lab in _exposure(s)} == {"orbax-run"},
        "the job whose trainer exited is still reported",
    )


def _rule(name: str) -> dict[str, Any]:
    groups = yaml.safe_load((PROMETHEUS / "ckptd-alerts.yml").read_text())["groups"]
    return next(r for g in groups for r in g["rules"] if r.get("alert") == name)


def test_job_names_can_be_kept_out_of_the_metrics(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon(extra_args=["--metrics-job-labels", "off"])
    a, b = daemon.client("secret-project-a"), daemon.client("secret-project-b")
    a.save(1, {"w": np.ones(64, np.float32)}).wait("local")
    b.save(1, {"w": np.ones(64, np.float32)}).wait("local")
    samples = scrape(daemon)
    assert not any("secret-project" in v for _, labels in samples for _, v in labels)
    # One series per tier: the node's worst running job.
    assert list(_exposure(samples)) == [(("tier", "local"),)]


def test_a_bad_metrics_job_labels_value_says_what_is_accepted() -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load(env={}, flags={"metrics_job_labels": "maybe"})
    assert "'metrics_job_labels'" in str(err.value) and "auto" in str(err.value)


def test_auto_shows_job_names_while_one_user_saves() -> None:
    assert job_labels_shown("auto", [], shared=False)
    assert job_labels_shown("auto", [1000, 1000], shared=False)
    assert not job_labels_shown("auto", [1000, 1001], shared=False)
    assert not job_labels_shown("auto", [1000], shared=True)
    assert job_labels_shown("on", [1000, 1001], shared=True)
    assert not job_labels_shown("off", [], shared=False)


def test_a_job_is_live_while_a_session_that_saved_it_is_open() -> None:
    live = LiveJobs()
    live.saving("t1", "a", 1000)
    live.saving("t2", "a", 0)
    live.saving("t2", "b", 0)
    assert live.uids() == {0, 1000}
    live.ended("t2")
    assert live.jobs() == {"a"} and live.uids() == {1000}
    live.ended("t1")
    live.ended("never-seen")
    assert live.jobs() == frozenset() and live.uids() == frozenset()


@pytest.fixture
def shared_node() -> Iterator[DaemonProcess]:
    """A daemon whose socket the two test users share (no shared jobs configured)."""
    with two_user_daemon("ckmet", []) as (_, daemon):
        yield daemon


def _as(user: str, socket: Path, *args: str, hold: bool = False) -> subprocess.Popen[str]:
    """The worker as ``user``; ``hold``: a trainer that keeps its session (a lease)."""
    proc = subprocess.Popen(
        **as_user(user, [*_python(), str(WORKER), str(socket), *args]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert ("lease_id" if hold else '"ok": true') in line, line
    if not hold:
        proc.communicate(timeout=120)
    return proc


def test_job_names_leave_the_metrics_once_two_users_save(shared_node: DaemonProcess) -> None:
    socket = shared_node.socket
    held = []
    try:
        _as(USERS[0], socket, "save", "alpha-secret", "1")
        held.append(_as(USERS[0], socket, "hold-lease", "alpha-secret", hold=True))
        one_user = scrape(shared_node)  # type: ignore[arg-type]
        assert (("job", "alpha-secret"), ("tier", "local")) in _exposure(one_user)
        _as(USERS[1], socket, "save", "beta-secret", "1")
        held.append(_as(USERS[1], socket, "hold-lease", "beta-secret", hold=True))
        two_users = scrape(shared_node)  # type: ignore[arg-type]
        names = {v for _, labels in two_users for _, v in labels}
        assert not {"alpha-secret", "beta-secret"} & names, sorted(names)
        assert list(_exposure(two_users)) == [(("tier", "local"),)]
    finally:
        for proc in held:
            proc.communicate(input="", timeout=120)


def test_a_privileged_trainer_counts_as_a_second_user(shared_node: DaemonProcess) -> None:
    """Root owns no job (operators never claim one), but the other user must not read
    its job names either: a root process saving makes two users."""
    socket = shared_node.socket
    _as(USERS[0], socket, "save", "alpha-secret", "1")
    held = _as(USERS[0], socket, "hold-lease", "alpha-secret", hold=True)
    try:
        client = Client("root-secret", socket=socket)
        try:
            client.save(1, {"w": np.ones(64, np.float32)}).wait("local")
            samples = scrape(shared_node)  # type: ignore[arg-type]
            names = {v for _, labels in samples for _, v in labels}
            assert not {"alpha-secret", "root-secret"} & names, sorted(names)
        finally:
            client.close()
        # Root's trainer gone, one user saves: job names are back.
        _scrape_until(
            shared_node,
            lambda s: (("job", "alpha-secret"), ("tier", "local")) in _exposure(s),
            "job names did not come back with one user left",
        )
    finally:
        held.communicate(input="", timeout=120)


def test_status_watch_shows_the_worst_job_when_names_are_hidden() -> None:
    """``ckptd status --watch`` reads the exposure from /metrics: without job labels
    it shows one row for the node's worst running job, not a KeyError."""
    from rich.console import Console

    from ckptd.daemon.app.cli_status import watch_view
    from ckptd.proto import ckptd_pb2 as pb

    scraped = {"ckptd_exposure_seconds": [({"tier": "local"}, 120.0)]}
    out = Console(width=120, record=True)
    out.print(watch_view(pb.DaemonStatus(node_id="n1"), scraped, None, 0.0))
    row = next(line for line in out.export_text().splitlines() if "(worst job)" in line)
    assert "2.0 min" in row, row
