"""Orbax users: a plain CheckpointManager writes into the directory ckptd watches.

Real daemons, real SeaweedFS S3 and fake-gcs-server; the trainer and the
readers are subprocesses running unmodified Orbax (tests/orbax_worker.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ckptd.client import orbax as ckptd_orbax
from ckptd.core.checksum import of_file as crc32c_file
from ckptd.proto import ckptd_pb2 as pb

from .conftest import Daemon, RemoteTarget
from .test_remote_tier import remote_daemon, s3_target

pytestmark = pytest.mark.slow  # Orbax training loops in jax subprocesses

pytest.importorskip("orbax.checkpoint")
REPO = Path(__file__).resolve().parent.parent
JOB = "run"


def worker(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run tests/orbax_worker.py; its last stdout line (JSON) if it prints one."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.orbax_worker", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def target(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> RemoteTarget:
    if kind == "file":
        return RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    server = request.getfixturevalue(f"{kind}_server")
    bucket = f"orbax-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    if kind == "s3":
        return s3_target(server, bucket)
    server.make_bucket(bucket)
    return RemoteTarget("gcs", f"gs://{bucket}/ckpt", server.env(), server)


def reader(remote: RemoteTarget) -> tuple[str, dict[str, str]]:
    """The path plain Orbax reads the job from, and the environment it needs for it."""
    if remote.kind == "file":
        return remote.url.removeprefix("file://") + f"/{JOB}", {}
    env = {
        **remote.env,
        # tensorstore's own GCS client, pointed at the emulator without credentials.
        "TENSORSTORE_GCS_HTTP_URL": remote.server.endpoint_url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
    }
    return f"{remote.url}/{JOB}", env


def tree_steps(remote: RemoteTarget) -> list[int]:
    """Steps with a tree in the bucket, as Orbax's listing would see the names."""
    return sorted({int(k.split("/")[1]) for k in remote.object_keys() if k.split("/")[1].isdigit()})


def wait_until(what: Any, want: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := what()) != want:
        assert time.monotonic() < deadline, f"got {got}, want {want}"
        time.sleep(0.2)


def bucket_crcs(remote: RemoteTarget, prefix: str) -> dict[str, int]:
    async def body(r: Any) -> dict[str, int]:
        keys = await r.list_keys(prefix)
        return {k[len(prefix) :]: await r.native_crc32c(k) for k in keys}

    got: dict[str, int] = remote.run(body)
    return got


@pytest.mark.parametrize("kind", ["file", "gcs"])
def test_orbax_steps_reach_the_bucket_and_plain_orbax_restores_them(
    kind: str, make_daemon: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    remote = target(kind, request, tmp_path)
    d: Daemon = remote_daemon(make_daemon, remote)
    out = tmp_path / "train.json"
    worker("train", str(d.socket), JOB, "6", str(out))
    trained = json.loads(out.read_text())
    assert trained["saved"] == [0, 1, 2, 3, 4, 5]
    assert sorted(trained["files"]) == ["4", "5"]  # Orbax's max_to_keep=2

    # Every step was adopted; the default remote retention keeps the newest three.
    wait_until(lambda: tree_steps(remote), [3, 4, 5])
    client = d.client(JOB)
    rows = {c.step: c for c in client.list()}
    assert sorted(s for s, c in rows.items() if "REMOTE" in c.tiers) == [3, 4, 5]
    assert all(c.adopted and c.num_shards == 0 for c in rows.values())
    assert rows[5].metrics == {"loss": 95.0}  # from Orbax's _CHECKPOINT_METADATA
    keys = remote.object_keys()
    for step in (4, 5):
        # Byte-identical: the same files with the same crc32c as Orbax wrote them.
        assert bucket_crcs(remote, f"{JOB}/{step}/") == trained["files"][str(step)]
        assert f"{JOB}/{step}.ckptd/_complete/test-node" in keys
        assert f"{JOB}/{step}.ckptd/test-node/manifest.json" in keys
    assert not [k for k in keys if k.split("/")[1] in ("0", "1", "2", "0.ckptd", "1.ckptd")]

    # Hard links: ckptd's copy is the very file Orbax wrote (no second copy on disk).
    orbax_dir = Path(trained["directory"])
    mine = d.root / JOB / "5" / "files" / "_CHECKPOINT_METADATA"
    assert mine.stat().st_ino == (orbax_dir / "5" / "_CHECKPOINT_METADATA").stat().st_ino

    # Orbax deleted step 3 itself; ckptd still holds it locally and links it back.
    assert not (orbax_dir / "3").exists()
    assert ckptd_orbax.ensure_local(client, 3) == 3
    assert crc32c_file(orbax_dir / "3" / "commit_success.txt") == crc32c_file(
        d.root / JOB / "3" / "files" / "commit_success.txt"
    )

    # The node is lost: plain Orbax restores straight from the bucket.
    path, env = reader(remote)
    assert ckptd_orbax.bucket_directory(client) == path
    d.kill()
    shutil.rmtree(d.root)
    assert worker("restore", path, env=env) == {"steps": [3, 4, 5], "restored": 5}


def test_s3_copies_come_back_through_ckptd(
    make_daemon: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Orbax cannot read s3://: ensure_local brings the step back into its directory."""
    remote = target("s3", request, tmp_path)
    d: Daemon = remote_daemon(make_daemon, remote)
    worker("train", str(d.socket), JOB, "4", str(tmp_path / "train.json"))
    wait_until(lambda: tree_steps(remote), [1, 2, 3])
    d.kill()
    shutil.rmtree(d.root)
    fresh: Daemon = remote_daemon(make_daemon, remote)  # a new node, empty disk
    got = worker("restore-via-ckptd", str(fresh.socket), JOB)
    assert got == {"steps": [3], "restored": 3, "ensured": 3}
    rows = {c.step: c for c in fresh.client(JOB).list()}
    assert rows[3].tiers == ("LOCAL", "REMOTE")
    assert [e.step for e in fresh.events_of(pb.STEP_EVENT_FETCHED, JOB)] == [3]
    assert (fresh.root / ".orbax" / JOB / "3" / "commit_success.txt").exists()  # put back


@pytest.mark.parametrize("kind", ["file", "gcs"])
def test_a_half_uploaded_step_is_invisible_to_orbax(
    kind: str, make_daemon: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    remote = target(kind, request, tmp_path)
    d: Daemon = remote_daemon(make_daemon, remote, "drain.before_tree_commit=pause")
    worker("train", str(d.socket), JOB, "1", str(tmp_path / "t.json"), "fixed", "local")
    d.wait_failpoint("drain.before_tree_commit")
    keys = remote.object_keys()
    path, env = reader(remote)
    assert worker("steps", path, env=env) == {"steps": []}
    assert f"{JOB}/0/commit_success.txt" not in keys
    assert f"{JOB}/0.ckptd/_complete/test-node" not in keys
    if kind == "gcs":  # the data is there, only the commit file is missing
        assert f"{JOB}/0/_CHECKPOINT_METADATA" in keys
    else:  # written under ckptd's records, renamed into place when whole
        assert f"{JOB}/0.ckptd/test-node/tree/_CHECKPOINT_METADATA" in keys
    d.kill()
    d.env.pop("CKPTD_FAILPOINTS")
    d.restart()
    d.client(JOB).list()
    ckptd_orbax.wait(d.client(JOB), 0, "durable", timeout=60)
    assert worker("steps", path, env=env) == {"steps": [0]}
    assert not [k for k in remote.object_keys() if "/tree/" in k]


def readme_example() -> str:
    """The MaxText-style example of the Orbax guide (docs/guides/orbax.md), exactly as printed."""
    text = (REPO / "docs/guides/orbax.md").read_text()
    return text.split("<!-- orbax-example -->\n```python\n", 1)[1].split("```", 1)[0]


README_PRELUDE = """
import json, os
import jax.numpy as jnp
run_name = "readme"
num_steps = int(os.environ["NUM_STEPS"])
state = {"w": jnp.zeros((256, 512), jnp.float32), "n": jnp.asarray(0, jnp.int32)}
abstract_state = state
def train_step(s):
    return {"w": s["w"] + 1.0, "n": s["n"] + 1}
"""
README_EPILOGUE = """
assert float(state["w"][0, 0]) == int(state["n"])
print(json.dumps({"start": start, "n": int(state["n"]), "latest": mngr.latest_step()}))
"""


def test_readme_orbax_example_runs_and_resumes_on_a_new_node(
    make_daemon: Any, tmp_path: Path
) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    script = tmp_path / "example.py"
    script.write_text(README_PRELUDE + readme_example() + README_EPILOGUE)

    def run(d: Daemon, steps: int) -> dict[str, Any]:
        env = {**os.environ, "CKPTD_SOCKET": str(d.socket), "NUM_STEPS": str(steps)}
        proc = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
        )
        assert proc.returncode == 0, proc.stderr[-5000:]
        result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        return result

    d: Daemon = remote_daemon(make_daemon, remote)
    first = run(d, 5)
    assert first["start"] is None and first["n"] == 5 and first["latest"] is not None
    d.kill()
    shutil.rmtree(d.root)  # the node is replaced: only the bucket has the steps
    second = run(remote_daemon(make_daemon, remote), 8)
    # Resumed from the newest step of the first run (fetched from the bucket), with
    # the state that step saved, and trained on to step 7.
    assert second == {"start": first["latest"], "n": 8, "latest": second["latest"]}
    assert second["latest"] is not None and second["latest"] > first["latest"]
