"""Bit flips in the local copy, the bucket copy, both, the manifest and the header.

A corrupt copy is never served; restore falls back to the other tier, then to
the newest older step that verifies; ``ls`` says why a step is skipped; the
drain never uploads bytes that changed after the commit; ``ckptd verify``
catches every one of them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from ckptd.client import CheckpointCorrupt
from ckptd.client.handle import SaveHandle
from ckptd.daemon.app.launcher import ckptd_command
from ckptd.proto import ckptd_pb2 as pb

from ..conftest import Daemon
from ..helpers import flip_byte, state_for
from .invariants import Ledger, check_all

MIB = 2
# The memory tier off: these faults are the disk's and the bucket's, and a restore
# served from the intact copy kept in memory would never read the flipped files.
ARGS = [
    "--drain-retry-max-seconds",
    "1",
    "--retention-local",
    "KeepLatest(10)",
    "--memory-tier-steps",
    "0",
]


def _setup(make_daemon: Any, tmp_path: Path, steps: int = 2) -> tuple[Daemon, Any, Ledger, str]:
    url = f"file://{tmp_path}/bucket"
    daemon: Daemon = make_daemon(extra_args=["--remote", url, *ARGS])
    client = daemon.client("flip")
    ledger = Ledger("flip", lambda s: state_for(s, MIB))
    for step in range(1, steps + 1):
        ledger.save(client, step).wait("durable", timeout=120)
    return daemon, client, ledger, url


def _local_file(daemon: Daemon, step: int) -> Path:
    return daemon.root / "flip" / str(step) / "rank-00000.safetensors"


def _bucket_file(tmp_path: Path, step: int) -> Path:
    # Rank files sit under <job>/_data/<hh>/<node>/<step>/ (daemon/remote/layout.py).
    return next((tmp_path / "bucket" / "flip").glob(f"_data/*/*/{step}.0/rank-00000.safetensors"))


def _restored(client: Any) -> tuple[int, bool]:
    tree, meta = client.restore()
    step = meta["step"]
    same = tree["w3"].tobytes() == state_for(step, MIB)["w3"].tobytes()
    del tree
    return step, same


def _verify(daemon: Daemon, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ckptd_command(), "verify", "--root", str(daemon.root), *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_local_copy_flipped_restores_the_bucket_copy(make_daemon: Any, tmp_path: Path) -> None:
    daemon, client, ledger, url = _setup(make_daemon, tmp_path)
    flip_byte(_local_file(daemon, 2), where=5000)
    assert _restored(client) == (2, True)  # step 2 again, fetched from the bucket
    check_all(daemon, client, ledger, remote_url=url)


def test_bucket_copy_flipped_is_reported_and_never_served(make_daemon: Any, tmp_path: Path) -> None:
    daemon, client, _ledger, url = _setup(make_daemon, tmp_path)
    flip_byte(_bucket_file(tmp_path, 2), where=5000)
    assert _restored(client) == (2, True)  # the local copy is intact
    run = _verify(daemon, "--remote", url)
    assert run.returncode == 1 and "CORRUPT  remote flip/2" in run.stdout, run.stdout


def test_both_copies_flipped_serves_the_older_step(make_daemon: Any, tmp_path: Path) -> None:
    daemon, client, _ledger, _url = _setup(make_daemon, tmp_path)
    flip_byte(_local_file(daemon, 2), where=5000)
    flip_byte(_bucket_file(tmp_path, 2), where=5000)
    assert _restored(client) == (1, True)
    row = next(c for c in client.list() if c.step == 2)
    assert "unusable" in row.error and "does not verify" in row.error
    with pytest.raises(CheckpointCorrupt):
        client.restore(step=2)
    assert _restored(client) == (1, True)  # and every later restore too


def test_unreadable_local_manifest_falls_back_to_the_bucket(
    make_daemon: Any, tmp_path: Path
) -> None:
    daemon, client, ledger, url = _setup(make_daemon, tmp_path)
    daemon.stop()
    (daemon.root / "flip" / "2" / "manifest.json").write_text("{ not json")
    daemon.restart()
    assert _restored(client) == (2, True)
    check_all(daemon, client, ledger, remote_url=url)


def test_bytes_changed_before_upload_fail_the_step_for_good(
    make_daemon: Any, tmp_path: Path
) -> None:
    url = f"file://{tmp_path}/bucket"
    daemon: Daemon = make_daemon(
        env={"CKPTD_FAILPOINTS": "drain.upload=pause"}, extra_args=["--remote", url, *ARGS]
    )
    client = daemon.client("flip")
    client.save(1, state_for(1, MIB), metadata={"step": 1}).wait("local")
    daemon.wait_failpoint("drain.upload")
    flip_byte(_local_file(daemon, 1), where=5000)  # bit rot between commit and upload
    daemon.release("drain.upload")
    failed = daemon.wait_event(lambda e: e.kind == pb.STEP_EVENT_FAILED and e.step == 1)
    assert "no longer matches" in failed.detail
    with pytest.raises(Exception, match="no longer matches"):
        SaveHandle(client, 1).wait("durable", timeout=60)
    assert not (daemon.root / "flip" / "1").exists()  # set aside, never served
    assert list((tmp_path / "bucket").rglob("_complete*")) == []


def test_verify_catches_header_corruption(make_daemon: Any, tmp_path: Path) -> None:
    daemon: Daemon = make_daemon()
    client = daemon.client("flip")
    client.save(1, state_for(1, MIB)).wait("local")
    assert _verify(daemon, "--local-only").returncode == 0
    flip_byte(_local_file(daemon, 1), where=20)  # inside the safetensors header
    run = _verify(daemon, "--local-only")
    assert run.returncode == 1 and "header or padding" in run.stdout, run.stdout
