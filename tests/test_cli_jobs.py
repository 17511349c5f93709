"""Every command that names a job offers the one meant ("did you mean"), and
``ckptd events`` says what became of a step rather than ``-> UNSPECIFIED``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ckptd.daemon.app.cli_jobs import did_you_mean
from ckptd.daemon.app.launcher import event_is
from ckptd.proto import ckptd_pb2 as pb

from .conftest import Daemon, RemoteTarget
from .test_cli_operate import run
from .test_remote_tier import remote_daemon


def test_did_you_mean_wording() -> None:
    assert did_you_mean("pretrian", ["pretrain", "eval"], "here") == "did you mean 'pretrain'?"
    assert did_you_mean("zzz", ["b", "a"], "here") == "jobs here: a, b"
    assert did_you_mean("zzz", [], "here") == ""
    many = did_you_mean("zzz", [f"job{i:02}" for i in range(25)], "here")
    assert many.endswith("job19 (and 5 more)")


def test_every_command_naming_a_job_suggests_the_one_meant(
    make_daemon: Any, tmp_path: Path
) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon: Daemon = remote_daemon(make_daemon, remote)
    daemon.client("pretrain-7b").save(5, {"w": np.ones(4)}).wait("durable", 120)
    sock = ["--socket", str(daemon.socket)]
    typo = "pretrian-7b"
    for args in (
        ["events", typo],
        ["pin", typo, "5"],
        ["unpin", typo, "5"],
        ["prefetch", typo],
        ["pull", typo, str(tmp_path / "dest")],
        ["verify", typo],
        ["verify", typo, "--remote-only"],
        ["ls", typo],
    ):
        out = run(*args, *sock)
        assert "did you mean 'pretrain-7b'?" in out.stderr, (args, out)
        assert "Traceback" not in out.stderr, out.stderr
        if args[0] != "ls":  # ls and events say "none" on stdout/stderr and exit 0
            assert out.returncode != 0 or args[0] == "events", (args, out)
    # The right name still works, and a name far from every job lists them.
    assert run("pin", "pretrain-7b", "5", *sock).returncode == 0
    out = run("events", "zzz", *sock)
    assert "no events for job 'zzz'" in out.stderr
    assert "jobs on this daemon: pretrain-7b" in out.stderr


def test_events_say_a_step_left_rather_than_unspecified(make_daemon: Any) -> None:
    # Local tier only, keeping one step: the first step's eviction leaves no copy.
    daemon: Daemon = make_daemon(extra_args=["--retention-local", "KeepLatest(1)"])
    client = daemon.client("ev")
    client.save(1, {"w": np.ones(4)}).wait("local")
    # Other bytes: step 2 references nothing of step 1, which nothing then keeps.
    client.save(2, {"w": np.full(4, 2.0)}).wait("local")
    evicted = daemon.wait_event(event_is(pb.STEP_EVENT_EVICTED_LOCAL, 1), job="ev")
    assert evicted.state == pb.SAVE_STATE_UNSPECIFIED  # the record itself is unchanged
    out = run("events", "ev", "--socket", str(daemon.socket))
    assert out.returncode == 0, out.stderr
    assert "UNSPECIFIED" not in out.stdout
    line = next(x for x in out.stdout.splitlines() if "ev/1 EVICTED_LOCAL" in x)
    assert "no copy left" in line, line
    assert "ev/2 LOCAL -> LOCAL (local)" in out.stdout
