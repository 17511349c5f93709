"""The remote tier on real servers: drain, layout, cuts, coalescing, restore from the bucket."""

from __future__ import annotations

import shutil
import subprocess
import time
from typing import Any

import numpy as np
import pytest

from ckptd.client import SaveFailed
from ckptd.client.handle import SaveHandle
from ckptd.core.manifest import rank_file_name
from ckptd.daemon.app.launcher import event_is
from ckptd.daemon.remote.layout import spread
from ckptd.proto import ckptd_pb2 as pb

from .conftest import CKPTD, Daemon, RemoteTarget
from .helpers import flip_byte, state_for


def s3_target(server: Any, bucket: str) -> RemoteTarget:
    """A fresh bucket on the session's S3 server."""
    server.make_bucket(bucket)
    return RemoteTarget("s3", f"s3://{bucket}/ckpt", server.env(), server)


def remote_daemon(
    make_daemon: Any,
    remote: RemoteTarget,
    failpoints: str = "",
    extra_args: list[str] | None = None,
    **kw: Any,
) -> Daemon:
    env = dict(remote.env)
    if failpoints:
        env["CKPTD_FAILPOINTS"] = failpoints
    d: Daemon = make_daemon(
        extra_args=[
            "--remote",
            remote.url,
            "--part-size-bytes",
            "5MiB",
            "--drain-concurrency",
            "4",
            "--drain-retry-max-seconds",
            "1",
            *(extra_args or []),
        ],
        env=env,
        **kw,
    )
    return d


def wait_until(pred: Any, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(0.05)


def expected_layout(job: str, steps: list[int], node: str = "test-node") -> list[str]:
    keys = [f"{job}/_index/{node}.json"] if steps else []  # the node's step index
    for s in steps:
        keys += [
            f"{job}/{s}/_complete/{node}",
            f"{job}/{s}/{node}/manifest.json",
            f"{job}/{s}/{node}/ranks-0-0",
            f"{job}/_data/{spread(node)}/{node}/{s}.0/rank-00000.safetensors",
        ]
    return sorted(keys)


def test_wiped_local_tier_restores_same_bits_from_bucket(
    make_daemon: Any, remote: RemoteTarget
) -> None:
    daemon = remote_daemon(make_daemon, remote)
    client = daemon.client("wipe")
    for step in (1, 2):
        client.save(step, state_for(step, 12), metadata={"step": step}).wait("durable", 120)
    assert [(c.step, c.state, c.tiers) for c in client.list()] == [
        (2, "DURABLE", ("MEMORY", "LOCAL", "REMOTE")),  # the newest kept in memory too
        (1, "DURABLE", ("LOCAL", "REMOTE")),
    ]
    assert daemon.stop() == 0
    shutil.rmtree(daemon.root)
    daemon.restart()
    client = daemon.client("wipe")
    assert [(c.step, c.tiers) for c in client.list()] == [(2, ("REMOTE",)), (1, ("REMOTE",))]
    tree, meta = client.restore()
    assert meta == {"step": 2}
    for k, v in state_for(2, 12).items():
        assert tree[k].tobytes() == v.tobytes()
    assert client.list()[0].tiers == ("LOCAL", "REMOTE")  # committed locally on the way
    older, _ = client.restore(step=1)
    assert older["w0"].tobytes() == state_for(1, 12)["w0"].tobytes()
    assert list((daemon.root / ".cache").iterdir()) == []


def test_bucket_layout_with_marker_last(make_daemon: Any, remote: RemoteTarget) -> None:
    daemon = remote_daemon(make_daemon, remote, "drain.before_marker=pause")
    client = daemon.client("lay")
    h = client.save(7, state_for(7, 8))
    daemon.wait_failpoint("drain.before_marker")
    # every object is there but the marker (and the index naming the step: it never names
    # one before its marker), and the step is not DURABLE
    assert remote.object_keys() == [
        k for k in expected_layout("lay", [7]) if "_complete" not in k and "_index" not in k
    ]
    assert h.state() == "DRAINING"
    daemon.release("drain.before_marker")
    h.wait("durable", 60)
    assert remote.object_keys() == expected_layout("lay", [7])


def test_aws_cli_lists_the_layout(make_daemon: Any, s3_server: Any) -> None:
    remote = s3_target(s3_server, "ckptd-awscli-layout")
    daemon = remote_daemon(make_daemon, remote)
    daemon.client("aws").save(3, state_for(3, 4)).wait("durable", 60)
    out = subprocess.run(
        ["aws", "s3", "ls", "--recursive", "s3://ckptd-awscli-layout/"],
        capture_output=True,
        text=True,
        env={**_os_env(), **s3_server.env()},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    keys = sorted(line.split()[-1] for line in out.stdout.splitlines())
    assert "ckpt/_nodes/test-node/instance" in keys  # the node name's claim
    keys = [k for k in keys if not k.startswith("ckpt/_nodes/")]
    assert keys == ["ckpt/" + k for k in expected_layout("aws", [3])]


def _os_env() -> dict[str, str]:
    import os

    return dict(os.environ)


@pytest.mark.slow  # stops and restarts its own object-store server; gcsfs retries for ~30 s
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_cut_upload_is_never_durable_and_completes_after_the_server_returns(
    make_daemon: Any, kind: str, request: pytest.FixtureRequest
) -> None:
    from .servers import FakeGCS, SeaweedS3

    server = SeaweedS3() if kind == "s3" else FakeGCS()  # its own: this test stops it
    with server:
        bucket = server.make_bucket("ckptd-cut")
        scheme = "s3" if kind == "s3" else "gs"
        remote = RemoteTarget(kind, f"{scheme}://{bucket}/ckpt", server.env(), server)
        # S3: held in the middle of a multipart upload (8 parts of 5 MiB); GCS (one
        # resumable upload per file, inside gcsfs): held just before the upload starts.
        point = "drain.part" if kind == "s3" else "drain.file"
        daemon = remote_daemon(make_daemon, remote, f"{point}=pause")
        client = daemon.client("cut")
        h = client.save(1, state_for(1, 40))
        daemon.wait_failpoint(point)
        assert h.state() == "DRAINING"
        server.stop()  # cut mid-drain
        daemon.release(point)
        # gcsfs retries each request itself for ~30 s before the drain sees the error
        retry = daemon.wait_event(event_is(pb.STEP_EVENT_RETRYING, 1), timeout=150)
        assert retry.state == pb.SAVE_STATE_DRAINING and "retrying" in retry.detail
        assert client.list()[0].state == "DRAINING"
        with pytest.raises(TimeoutError):
            h.wait("durable", timeout=1)
        server.start()
        h.wait("durable", 180)
        assert remote.object_keys() == expected_layout("cut", [1])
        if kind == "s3":
            assert server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
        shutil.rmtree(daemon.root / "cut")  # and the bucket copy is whole:
        daemon.stop()
        daemon.restart()
        tree, _ = daemon.client("cut").restore()
        assert tree["w3"].tobytes() == state_for(1, 40)["w3"].tobytes()


def test_drain_never_delays_the_next_save(make_daemon: Any, s3_server: Any) -> None:
    remote = s3_target(s3_server, "ckptd-nodelay")
    daemon = remote_daemon(make_daemon, remote)
    client = daemon.client("nodelay")
    client.save(1, state_for(1, 4)).wait("durable", 60)
    s3_server.pause()  # the drain hangs on a frozen server
    try:
        h2 = client.save(2, state_for(2, 4))
        wait_until(lambda: h2.state() == "DRAINING", what="step 2 draining")
        for step in (3, 4):  # handoffs and local commits go on regardless
            client.save(step, state_for(step, 4)).wait("local", timeout=30)
        assert {c.step: c.state for c in client.list()}[4] == "LOCAL"
    finally:
        s3_server.resume()
    client.save(5, state_for(5, 4)).wait("durable", 120)


def test_coalescing_uploads_newest_and_milestones_only(
    make_daemon: Any, remote: RemoteTarget
) -> None:
    daemon = remote_daemon(
        make_daemon,
        remote,
        "drain.before_marker=pause",
        extra_args=["--retention-remote", "KeepLatest(1)", "--retention-local", "KeepAll()"],
    )
    client = daemon.client("co")
    handles = {0: client.save(0, {"x": np.full(1000, 0)}, milestone=True)}
    daemon.wait_failpoint("drain.before_marker")  # step 0 is held at its marker...
    for s in range(1, 6):  # ...while 1..5 are saved
        handles[s] = client.save(s, {"x": np.full(1000, s)}, milestone=s == 3)
        handles[s].wait("local", 30)
    daemon.release("drain.before_marker")
    for s in (0, 3, 5):
        handles[s].wait("durable", 120)
    # The newest, 5, went next and superseded 1, 2 and 4; the milestone 3 went up too.
    wait_until(lambda: remote.object_keys() == expected_layout("co", [0, 3, 5]), what="layout")
    durable = [e.step for e in daemon.events_of(pb.STEP_EVENT_DURABLE, "co")]
    assert durable == [0, 5, 3]
    states = {c.step: c.state for c in client.list()}
    assert states == {
        0: "DURABLE",
        1: "SUPERSEDED",
        2: "SUPERSEDED",
        3: "DURABLE",
        4: "SUPERSEDED",
        5: "DURABLE",
    }
    with pytest.raises(SaveFailed, match=r"superseded by step 5"):
        handles[2].wait("durable", 10)
    handles[2].wait("local", 10)  # still a fine local checkpoint


def test_flipped_local_byte_is_served_from_the_bucket(make_daemon: Any, s3_server: Any) -> None:
    remote = s3_target(s3_server, "ckptd-flip")
    # The memory tier off: its intact copy would be served and the disk's never read.
    daemon = remote_daemon(make_daemon, remote, extra_args=["--memory-tier-steps", "0"])
    client = daemon.client("flip")
    client.save(1, state_for(1, 4)).wait("durable", 60)
    flip_byte(daemon.root / "flip" / "1" / "rank-00000.safetensors", where=-10)
    tree, _ = client.restore(step=1)
    assert tree["w2"].tobytes() == state_for(1, 4)["w2"].tobytes()
    assert [e.step for e in daemon.events_of(pb.STEP_EVENT_SET_ASIDE, "flip")] == [1]
    assert [e.step for e in daemon.events_of(pb.STEP_EVENT_FETCHED, "flip")] == [1]
    assert client.list()[0].tiers == ("LOCAL", "REMOTE")


@pytest.mark.parametrize(
    ("url", "env", "match"),
    [
        ("s3://ckptd-no-such-bucket/x", "s3", "does not exist"),
        ("s3://ckptd-any-bucket/x", "nocreds", "no AWS credentials"),
        ("ftp://host/x", "s3", "invalid value for 'remote'"),
        ("gs://ckptd-no-such-bucket/x", "gcs", "ckptd-no-such-bucket"),
    ],
)
def test_bad_remote_is_one_clear_error_at_start_up(
    tmp_path: Any, s3_server: Any, gcs_server: Any, url: str, env: str, match: str
) -> None:
    environ = {k: v for k, v in _os_env().items() if not k.startswith(("AWS_", "CKPTD_"))}
    if env == "s3":
        environ.update(s3_server.env())
    elif env == "gcs":
        environ.update(gcs_server.env())
    else:
        environ.update(
            AWS_CONFIG_FILE="/nonexistent",
            AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
            AWS_EC2_METADATA_DISABLED="true",
            AWS_ENDPOINT_URL_S3=s3_server.endpoint_url,
        )
    start = time.monotonic()
    out = subprocess.run(
        [
            CKPTD,
            "serve",
            "--root",
            str(tmp_path / "r"),
            "--socket",
            str(tmp_path / "s.sock"),
            "--remote",
            url,
        ],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("ckptd: error:")]
    assert len(errors) == 1 and match in errors[0], out.stderr
    assert "Traceback" not in out.stderr and "retrying" not in out.stderr
    assert time.monotonic() - start < 60  # one check, not a stack of retries


def test_upload_resumes_after_a_daemon_restart(make_daemon: Any, s3_server: Any) -> None:
    remote = s3_target(s3_server, "ckptd-resume")
    daemon = remote_daemon(make_daemon, remote, "drain.before_marker=pause")
    client = daemon.client("res")
    client.save(4, state_for(4, 12)).wait("local")
    daemon.wait_failpoint("drain.before_marker")
    daemon.kill()  # files and manifest are in the bucket, the marker is not
    assert "res/4/_complete/test-node" not in remote.object_keys()
    daemon.env = dict(remote.env)
    daemon.restart()
    client = daemon.client("res")
    SaveHandle(client, 4).wait("durable", 120)
    (durable,) = daemon.events_of(pb.STEP_EVENT_DURABLE, "res", 4)
    assert dict(durable.attributes) == {"files_sent": "0", "files_skipped": "1"}
    assert remote.object_keys() == expected_layout("res", [4])


def test_pull_and_verify_commands(make_daemon: Any, s3_server: Any, tmp_path: Any) -> None:
    remote = s3_target(s3_server, "ckptd-pull")
    daemon = remote_daemon(make_daemon, remote)
    client = daemon.client("pl")
    client.save(1, state_for(1, 6)).wait("durable", 60)
    client.save(2, state_for(2, 6)).wait("durable", 60)
    env = {**_os_env(), **remote.env}
    dest = tmp_path / "pulled"
    out = subprocess.run(
        [CKPTD, "pull", "pl", str(dest), "--remote", remote.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "pulled pl step 2" in out.stdout and "6.0 MiB of 6.0 MiB (100%)" in out.stderr
    local = daemon.root / "pl" / "2"
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in local.iterdir())
    for f in local.iterdir():
        assert (dest / f.name).read_bytes() == f.read_bytes()
    verify = [CKPTD, "verify", "--root", str(daemon.root), "--remote", remote.url]
    out = subprocess.run(verify, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 copies checked, 0 corrupt" in out.stdout
    flip_byte(local / "rank-00000.safetensors", where=5000)
    out = subprocess.run(verify, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and "CORRUPT  local pl/2" in out.stdout
    out = subprocess.run(
        [CKPTD, "pull", "pl", str(tmp_path / "x"), "--step", "9", "--remote", remote.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2 and "step 9 of job 'pl' is not complete" in out.stderr


def test_several_ranks_restore_from_the_bucket_together(make_daemon: Any, tmp_path: Any) -> None:
    from concurrent.futures import ThreadPoolExecutor

    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon = remote_daemon(make_daemon, remote)
    ranks = [daemon.client("mr", rank=r, node_ranks=[0, 1, 2], world_size=3) for r in range(3)]
    handles = [c.save(9, state_for(10 + c.rank, 4), metadata={"r": c.rank}) for c in ranks]
    handles[0].wait("durable", 60)
    assert remote.object_keys() == sorted(
        ["mr/9/_complete/test-node", "mr/9/test-node/manifest.json", "mr/_index/test-node.json"]
        + ["mr/9/test-node/ranks-0-2"]
        + [f"mr/_data/{spread('test-node')}/test-node/9.0/{rank_file_name(r)}" for r in range(3)]
    )
    daemon.stop()
    shutil.rmtree(daemon.root)
    daemon.restart()
    clients = [daemon.client("mr", rank=r, node_ranks=[0, 1, 2], world_size=3) for r in range(3)]
    with ThreadPoolExecutor(3) as pool:
        restored = list(pool.map(lambda c: c.restore(), clients))
    for r, (tree, _meta) in enumerate(restored):
        assert tree["w1"].tobytes() == state_for(10 + r, 4)["w1"].tobytes()
    (fetched,) = daemon.events_of(pb.STEP_EVENT_FETCHED, "mr", 9)
    assert fetched.attributes["via"] == "shared memory"


def test_a_late_write_of_the_manifest_is_caught_before_the_marker(
    make_daemon: Any, remote: RemoteTarget
) -> None:
    """An upload of an earlier save under the same number, cut when the new save
    replaced it, may land its manifest after the new one's: the drain reads the
    manifest back before the marker and sends it again, so the marker never commits
    another save's manifest."""
    daemon = remote_daemon(make_daemon, remote, "drain.before_marker=pause")
    client = daemon.client("late")
    h = client.save(1, state_for(1, 4))
    daemon.wait_failpoint("drain.before_marker")
    key = "late/1/test-node/manifest.json"
    sent: bytes = remote.run(lambda r: r.get_bytes(key))
    stale = sent.replace(b'"created_unix":', b'"created_unix": 1.0, "x_stale":', 1)
    assert stale != sent

    async def late_write(r: Any) -> None:
        await r.put_bytes(key, stale)

    remote.run(late_write)
    daemon.release("drain.before_marker")
    h.wait("durable", 60)
    assert remote.run(lambda r: r.get_bytes(key)) == sent
    tree, _ = client.restore(step=1)
    assert tree["w0"].tobytes() == state_for(1, 4)["w0"].tobytes()
