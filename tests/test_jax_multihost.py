"""Two JAX processes (jax.distributed on 127.0.0.1, gloo), each with its own daemon."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptd.proto import ckptd_pb2 as pb

from .conftest import RemoteTarget
from .test_remote_tier import remote_daemon

pytestmark = pytest.mark.slow  # multi-process jax jobs with gloo

pytest.importorskip("jax")
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(sockets: list[Path], mode: str) -> None:
    """Run one worker per daemon as a two-process jax job; fail with their output."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.jax_worker", str(i), str(port), str(s), mode, "2"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, s in enumerate(sockets)
    ]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outputs.append(out)
    for p in procs:
        assert p.returncode == 0, "\n".join(o[-3000:] for o in outputs)


def test_two_processes_save_to_a_shared_bucket_and_restore_on_new_nodes(
    make_daemon: Any, tmp_path: Path
) -> None:
    bucket = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemons = [
        remote_daemon(make_daemon, bucket, extra_args=["--node-id", f"node-{i}"]) for i in (0, 1)
    ]
    run_job([d.socket for d in daemons], "save")
    keys = bucket.object_keys()
    assert {"mh/2/_complete/node-0", "mh/2/_complete/node-1"} <= set(keys)
    # Both nodes are lost: new daemons with empty roots, the same bucket.
    for d in daemons:
        d.stop()
        shutil.rmtree(d.root)
        d.start()
    run_job([d.socket for d in daemons], "restore")
    for d in daemons:
        assert [e.step for e in d.events_of(pb.STEP_EVENT_FETCHED)] == [2]
    # One process with another device count: it needs rows node-1 saved, which its
    # daemon fetches from the bucket.
    for devices in ("4", "1"):
        worker = [sys.executable, "-m", "tests.jax_worker", "0", "-", str(daemons[0].socket)]
        out = subprocess.run(
            [*worker, "single", "1", devices],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert f"alone on {devices} devices: restored" in out.stdout
    peers = daemons[0].events_of(pb.STEP_EVENT_PEERS_FETCHED)
    assert [(e.step, e.attributes["node"]) for e in peers] == [(2, "node-1")]
    # Mixed tiers: node-0 holds step 2 locally now, node-1 loses its disk once more.
    # The processes still agree on step 2; only node-1 goes to the bucket.
    daemons[1].stop()
    shutil.rmtree(daemons[1].root)
    daemons[1].start()
    already = len(daemons[0].events_of(pb.STEP_EVENT_FETCHED))
    run_job([d.socket for d in daemons], "restore")
    fetched = [len(d.events_of(pb.STEP_EVENT_FETCHED)) for d in daemons]
    assert fetched == [already, 1], fetched  # node-0 fetched nothing new
