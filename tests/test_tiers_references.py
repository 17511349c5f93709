"""Each tier holds what its steps reference, against real daemons (and a real S3
bucket): retention keeps holders, the drain uploads them first. The incremental
steps are made by hand (incremental_steps.py) on a stopped daemon's disk."""

from __future__ import annotations

import shutil
import subprocess
import time
from typing import Any

import numpy as np

from ckptd.client import Client
from ckptd.core import checksum
from ckptd.core.manifest import MANIFEST, Manifest
from ckptd.proto import ckptd_pb2 as pb

from .conftest import CKPTD, Daemon
from .incremental_steps import make_incremental
from .test_remote_tier import _os_env, remote_daemon, s3_target
from .test_retention_tier import bucket_steps, settled

JOB = "inc"


def state() -> dict[str, Any]:
    """The same arrays at every step: a later step's shards are its holder's bytes."""
    return {f"w{i}": np.arange(300_000, dtype=np.float32) + i for i in range(3)}


def three_steps_then_incremental(make_daemon: Any, extra_args: list[str] | None = None) -> Daemon:
    """A stopped daemon whose disk holds steps 1, 2 (full) and 3 (referencing 1)."""
    daemon: Daemon = make_daemon(extra_args=["--retention-local", "KeepAll()", *(extra_args or [])])
    client = daemon.client(JOB, incremental=False)  # full files; step 3's made by hand
    for step in (1, 2, 3):
        client.save(step, state(), metadata={"step": step}).wait("local", 60)
    assert daemon.stop() == 0
    make_incremental(daemon.root, JOB, 3, holder=1)
    return daemon


def wait_state(client: Client, step: int, want: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        row = next((c for c in client.list() if c.step == step), None)
        if row is not None and row.state == want:
            return row
        assert time.monotonic() < deadline, row
        time.sleep(0.1)


def test_local_retention_keeps_a_referenced_step_and_says_why(make_daemon: Any) -> None:
    daemon = three_steps_then_incremental(make_daemon)
    daemon.extra_args += ["--retention-local", "KeepLatest(1)"]
    daemon.start()
    client = daemon.client(JOB)
    settled(client, [1, 3], [])
    why = {c.step: c.local_reasons for c in client.list()}
    assert why[1] == ("referenced-by-step-3",)
    out = subprocess.run(
        [CKPTD, "ls", JOB, "--socket", str(daemon.socket)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    row_1 = next(line for line in out.stdout.splitlines() if line.split()[1] == "1")
    assert "local=referenced-by-step-3" in row_1
    tree, _ = client.restore(step=1)  # the holder is whole: it restores
    assert np.array_equal(tree["w2"], state()["w2"])


def test_the_drain_uploads_a_holder_first_though_the_policy_skips_it(
    make_daemon: Any, s3_server: Any
) -> None:
    remote = s3_target(s3_server, "ckptd-inc-order")
    daemon = three_steps_then_incremental(make_daemon)
    restarted = remote_daemon(
        make_daemon,
        remote,
        extra_args=["--retention-local", "KeepAll()", "--retention-remote", "KeepLatest(1)"],
        root=daemon.root,
        socket=daemon.socket,
    )
    client = restarted.client(JOB)
    wait_state(client, 3, "DURABLE")
    uploaded = [e.step for e in restarted.events_of(pb.STEP_EVENT_DURABLE, JOB)]
    assert uploaded == [1, 3]  # the holder first, though the newest goes first otherwise
    wait_state(client, 2, "SUPERSEDED")
    assert bucket_steps(remote, JOB) == [1, 3]
    why = {c.step: c.remote_reasons for c in client.list()}
    assert why[1] == ("referenced-by-step-3",)


def test_a_step_whose_holder_is_gone_is_not_uploaded(make_daemon: Any, s3_server: Any) -> None:
    remote = s3_target(s3_server, "ckptd-inc-lost")
    daemon = three_steps_then_incremental(make_daemon)
    for f in sorted((daemon.root / JOB / "1").iterdir()):
        f.unlink()  # what the local tier's rules never let happen
    (daemon.root / JOB / "1").rmdir()
    restarted = remote_daemon(
        make_daemon,
        remote,
        root=daemon.root,
        socket=daemon.socket,
        extra_args=["--retention-local", "KeepAll()"],
    )
    client = restarted.client(JOB)
    row = wait_state(client, 3, "FAILED")
    assert "step 1, whose rank files step 3 references, is neither in the bucket" in row.error
    assert 3 not in bucket_steps(remote, JOB)


def in_the_bucket_then_wiped(make_daemon: Any, remote: Any) -> Daemon:
    """Steps 1, 2 (full) and 3 (referencing 1) all DURABLE, then the local disk lost:
    a fresh daemon on the same bucket, with nothing local."""
    daemon = three_steps_then_incremental(make_daemon)
    uploader = remote_daemon(
        make_daemon, remote, extra_args=["--retention-local", "KeepAll()"], root=daemon.root
    )
    client = uploader.client(JOB)
    for step in (1, 2, 3):
        wait_state(client, step, "DURABLE")
    assert uploader.stop() == 0
    shutil.rmtree(daemon.root)
    return remote_daemon(
        make_daemon, remote, extra_args=["--retention-local", "KeepAll()"], root=daemon.root
    )


def prefetch(daemon: Daemon) -> str:
    out = subprocess.run(
        [CKPTD, "prefetch", JOB, "--socket", str(daemon.socket)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_step_from_the_bucket_brings_its_holders(make_daemon: Any, s3_server: Any) -> None:
    remote = s3_target(s3_server, "ckptd-inc-bring")
    daemon = in_the_bucket_then_wiped(make_daemon, remote)
    assert prefetch(daemon).startswith(f"{JOB}/3: local (fetched from the bucket")
    local = sorted(c.step for c in daemon.client(JOB).list() if "LOCAL" in c.tiers)
    assert local == [1, 3]  # the holder came first, whole
    tree, _ = daemon.client(JOB).restore(step=1)
    assert np.array_equal(tree["w1"], state()["w1"])


def test_a_holder_corrupt_in_the_bucket_passes_to_the_next_older_step(
    make_daemon: Any, s3_server: Any
) -> None:
    remote = s3_target(s3_server, "ckptd-inc-corrupt")
    daemon = in_the_bucket_then_wiped(make_daemon, remote)
    key = next(k for k in remote.object_keys() if "/test-node/1.0/rank-" in k)

    async def flip_a_byte(r: Any) -> None:
        data = bytearray(await r.get_bytes(key))
        data[-1] ^= 0xFF
        await r.put_bytes(key, bytes(data))

    remote.run(flip_a_byte)
    _, metadata = daemon.client(JOB).restore()  # step 3 cannot be: the next older one
    assert metadata["step"] == 2
    rows = {c.step: c for c in daemon.client(JOB).list()}
    assert "LOCAL" not in rows[3].tiers
    assert "step 1, whose rank files it references, cannot be restored" in rows[3].error


def test_pull_makes_an_incremental_step_whole_and_verify_checks_its_holders(
    make_daemon: Any, s3_server: Any, tmp_path: Any
) -> None:
    remote = s3_target(s3_server, "ckptd-inc-pull")
    daemon: Daemon = make_daemon(extra_args=["--retention-local", "KeepAll()"])
    client = daemon.client(JOB, incremental=False)
    for step in (1, 2, 3):
        client.save(step, state(), metadata={"step": step}).wait("local", 60)
    assert daemon.stop() == 0
    images = {f.name: f.read_bytes() for f in (daemon.root / JOB / "3").glob("rank-*")}
    make_incremental(daemon.root, JOB, 3, holder=1)
    uploader = remote_daemon(
        make_daemon, remote, extra_args=["--retention-local", "KeepAll()"], root=daemon.root
    )
    for step in (1, 2, 3):
        wait_state(uploader.client(JOB), step, "DURABLE")
    assert uploader.stop() == 0
    env = {**_os_env(), **remote.env}

    def ckptd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [CKPTD, *args, "--remote", remote.url], capture_output=True, text=True, env=env
        )

    out = ckptd("pull", JOB, str(tmp_path / "pulled"), "--step", "3")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "whole: what it shares with steps [1] copied in" in out.stdout
    pulled = Manifest.from_json((tmp_path / "pulled" / MANIFEST).read_text())
    assert not any(r.incremental for r in pulled.ranks) and pulled.increment == 0
    for r in pulled.ranks:  # each rank file as a full save wrote it, checked as one
        data = (tmp_path / "pulled" / r.file).read_bytes()
        assert data == images[r.file] and checksum.value(data) == r.crc32c
    assert not [f for f in tmp_path.iterdir() if ".ckptd-pull." in f.name]  # no staging left

    out = ckptd("verify", "--remote-only", JOB)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 copies checked, 0 corrupt" in out.stdout
    marker = next(k for k in remote.object_keys() if k.startswith(f"{JOB}/1/_complete/"))

    async def drop(r: Any) -> None:
        await r.delete([marker])

    remote.run(drop)  # step 1 is no longer complete in the bucket; step 3 reads it
    out = ckptd("verify", "--remote-only", JOB)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "2 copies checked, 1 corrupt" in out.stdout
    row = next(line for line in out.stdout.splitlines() if f"remote {JOB}/3/" in line)
    assert "CORRUPT" in row and "its references' step 1 is missing" in row
    out = ckptd("pull", JOB, str(tmp_path / "again"), "--step", "3")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "reads part of its data from step 1" in out.stderr
