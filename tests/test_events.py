"""Step events and supervision through a real daemon: ListEvents, `ckptd events`,
`ckptd status`, and a crashed background service that comes back."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from ckptd.daemon.app.launcher import event_is
from ckptd.proto import ckptd_pb2 as pb

from .conftest import CKPTD, Daemon, RemoteTarget
from .test_remote_tier import remote_daemon


def test_a_save_is_a_sequence_of_events(make_daemon: Any, tmp_path: Path) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon: Daemon = remote_daemon(make_daemon, remote)
    client = daemon.client("ev")
    client.save(1, {"x": np.arange(10)}).wait("durable", 60)
    rows = daemon.events("ev")
    assert [pb.StepEvent.Name(e.kind) for e in rows] == [
        "STEP_EVENT_STAGED",
        "STEP_EVENT_LOCAL",
        "STEP_EVENT_DRAINING",
        "STEP_EVENT_DURABLE",
    ]
    assert [e.state for e in rows] == [
        pb.SAVE_STATE_STAGING,
        pb.SAVE_STATE_LOCAL,
        pb.SAVE_STATE_DRAINING,
        pb.SAVE_STATE_DURABLE,
    ]
    assert list(rows[-1].tiers) == [pb.TIER_LOCAL, pb.TIER_REMOTE]
    assert daemon.status().last_event_seq == rows[-1].seq
    # A waiting ListEvents answers as soon as the next event exists.
    client.save(2, {"x": np.arange(10)})
    staged = daemon.wait_event(event_is(pb.STEP_EVENT_STAGED, 2), after=rows[-1].seq)
    assert staged.job == "ev"
    out = subprocess.run(
        [CKPTD, "events", "ev", "--socket", str(daemon.socket)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "ev/1 STAGED -> STAGING" in out.stdout and "ev/1 DURABLE -> DURABLE" in out.stdout
    out = subprocess.run(
        [CKPTD, "events", "--json", "--socket", str(daemon.socket)], capture_output=True, text=True
    )
    first = json.loads(out.stdout.splitlines()[0])
    assert (first["kind"], first["state"], first["step"]) == ("STAGED", "STAGING", 1)


def test_a_crashed_drain_is_restarted_and_shown(make_daemon: Any, tmp_path: Path) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    # The drain's loop raises once, outside any upload: it must not stop uploading.
    daemon: Daemon = remote_daemon(make_daemon, remote, "drain.loop=enospc_once")
    client = daemon.client("sup")
    client.save(1, {"x": np.arange(10)}).wait("durable", 60)
    tasks = {t.name: t for t in daemon.status().tasks}
    # claim: the node name's; node-fleet: the sample of the names' records
    assert set(tasks) == {"drain", "evictor", "adopter", "claim", "node-fleet"}
    assert tasks["drain"].state == "running" and tasks["drain"].restarts == 1
    assert "No space left on device" in tasks["drain"].last_error
    assert tasks["evictor"].restarts == 0
    out = subprocess.run(
        [CKPTD, "status", "--socket", str(daemon.socket)], capture_output=True, text=True
    )
    assert "drain running (1 restarts: OSError" in out.stdout
    status = json.loads(
        subprocess.run(
            [CKPTD, "status", "--json", "--socket", str(daemon.socket)],
            capture_output=True,
            text=True,
        ).stdout
    )
    assert {t["name"]: t["restarts"] for t in status["tasks"]}["drain"] == 1
