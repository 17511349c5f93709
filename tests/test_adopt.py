"""Adopting directories other frameworks wrote: the scanner's rules, and `ckptd adopt`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client import CkptdError, SaveFailed
from ckptd.client import orbax as ckptd_orbax
from ckptd.core.checksum import of_file as crc32c_file
from ckptd.core.errors import InvalidArgument
from ckptd.core.manifest import KIND_DIRECTORY, Manifest
from ckptd.daemon.adopt.tree import (
    HF,
    ORBAX,
    TORCHTITAN,
    finished_steps,
    layout_named,
    link_tree,
    orbax_metrics,
    put_back,
    tree_files,
)
from ckptd.proto import ckptd_pb2 as pb

from .conftest import CKPTD, Daemon, RemoteTarget
from .test_remote_tier import remote_daemon


def orbax_like(step_dir: Path, finished: bool = True, seed: int = 0) -> None:
    """A directory shaped like an Orbax step (content is random bytes)."""
    rng = np.random.default_rng(seed)
    (step_dir / "default" / "d").mkdir(parents=True)
    (step_dir / "_CHECKPOINT_METADATA").write_text('{"metrics": {"loss": 2.5, "ok": true}}')
    (step_dir / "default" / "d" / "abc").write_bytes(rng.bytes(300_000))
    (step_dir / "default" / "_METADATA").write_text("{}")
    if finished:
        (step_dir / "commit_success.txt").write_text("Checkpoint commit was successful")


def test_finished_steps_follow_orbax_naming(tmp_path: Path) -> None:
    orbax_like(tmp_path / "7")
    orbax_like(tmp_path / "12")
    orbax_like(tmp_path / "8", finished=False)  # commit_success.txt not written yet
    orbax_like(tmp_path / "9.orbax-checkpoint-tmp-1234")  # Orbax's in-progress name
    orbax_like(tmp_path / "0010")  # zero-padded: would not match <job>/<step> in the bucket
    orbax_like(tmp_path / "checkpoint_11")  # step_prefix names: left alone
    (tmp_path / "13").write_text("a file, not a step")
    assert [(s, p.name) for s, p, _ in finished_steps(tmp_path)] == [(7, "7"), (12, "12")]
    assert finished_steps(tmp_path / "missing") == []


def test_tree_files_and_links(tmp_path: Path) -> None:
    src = tmp_path / "src"
    orbax_like(src)
    assert tree_files(src) == [
        "_CHECKPOINT_METADATA",
        "commit_success.txt",
        "default/_METADATA",
        "default/d/abc",
    ]
    staging = tmp_path / "staging"
    staging.mkdir()
    records = link_tree(src, staging)
    for r in records:
        assert r.file.startswith("files/")
        copy, original = staging / r.file, src / r.file.removeprefix("files/")
        assert copy.stat().st_ino == original.stat().st_ino  # a hard link, not a copy
        assert (r.size, r.crc32c) == (original.stat().st_size, crc32c_file(original))
    assert orbax_metrics(src) == {"loss": 2.5}  # booleans are not metrics

    (src / "default" / "link").symlink_to(src / "commit_success.txt")
    with pytest.raises(InvalidArgument, match="symlink"):
        tree_files(src)
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    with pytest.raises(InvalidArgument, match="no files"):
        tree_files(empty)


def test_crc32c_file_matches_whole_file_crc(tmp_path: Path) -> None:
    import google_crc32c

    data = np.random.default_rng(1).bytes(20 * 2**20 + 17)
    (tmp_path / "f").write_bytes(data)
    assert crc32c_file(tmp_path / "f", chunk=2**20) == google_crc32c.value(data)


def dcp_like(path: Path) -> dict[str, bytes]:
    """A PyTorch DCP FileSystemWriter-shaped directory."""
    rng = np.random.default_rng(3)
    files = {
        ".metadata": rng.bytes(5_000),
        "__0_0.distcp": rng.bytes(6 * 2**20 + 3),
        "__1_0.distcp": rng.bytes(100),
        "extra/tokenizer.json": b"{}",
    }
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return files


def test_ckptd_adopt_drains_a_directory_byte_identical(make_daemon: Any, tmp_path: Path) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    d: Daemon = remote_daemon(make_daemon, remote)
    src = tmp_path / "dcp" / "step-100"
    files = dcp_like(src)
    sock = ["--socket", str(d.socket)]
    out = subprocess.run(
        [CKPTD, "adopt", "job", "100", str(src), "--wait", "durable", *sock],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "adopted from" in out.stdout and "DURABLE" in out.stdout
    bucket = tmp_path / "bucket" / "job"
    for name, data in files.items():
        assert (bucket / "100" / name).read_bytes() == data
    assert (bucket / "100.ckptd" / "_complete" / "test-node").exists()
    verify = subprocess.run(
        [CKPTD, "verify", "job", "--root", str(d.root), "--remote", remote.url],
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0 and "2 copies checked, 0 corrupt" in verify.stdout, verify
    # The source can go: ckptd holds its own links.
    for name in files:
        (src / name).unlink()

    client = d.client("job")
    [row] = client.list()
    assert row.adopted and row.source == str(src) and row.tiers == ("LOCAL", "REMOTE")
    with pytest.raises(CkptdError, match="adopted"):
        client.restore(step=100)

    # An empty directory: refused with what to do. (A save or an adoption under the
    # number of a step held here is a new timeline's, replacing it: test_timeline.py.)
    out = subprocess.run(
        [CKPTD, "adopt", "job", "100", str(tmp_path / "dcp"), *sock], capture_output=True, text=True
    )
    assert out.returncode == 2 and "nothing to adopt" in out.stderr, out.stderr
    out = subprocess.run(
        [CKPTD, "adopt", "job", "101", str(tmp_path / "nope"), *sock],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "not a directory" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr

    # `ckptd pull` brings the tree itself back from the bucket, checked file by file.
    dest = tmp_path / "pulled"
    pull = subprocess.run(
        [CKPTD, "pull", "job", str(dest), "--remote", remote.url], capture_output=True, text=True
    )
    assert pull.returncode == 0, pull.stderr
    pulled = sorted(str(f.relative_to(dest)) for f in dest.rglob("*") if f.is_file())
    assert pulled == sorted(files)  # the tree itself: no manifest.json, no files/
    for name, data in files.items():
        assert (dest / name).read_bytes() == data

    # The client API does the same; a wiped node gets the tree back from the bucket.
    src2 = tmp_path / "dcp" / "step-200"
    dcp_like(src2)
    client.adopt(200, src2, metrics={"loss": 1.0}).wait("durable", timeout=60)
    d.kill()
    shutil.rmtree(d.root)
    fresh: Daemon = remote_daemon(make_daemon, remote)
    c2 = fresh.client("job")
    target_dir = tmp_path / "restored"
    assert ckptd_orbax.ensure_local(c2, directory=target_dir) == 200
    for name, data in files.items():
        assert (target_dir / "200" / name).read_bytes() == data
    listed = subprocess.run(
        [CKPTD, "ls", "job", "--json", "--socket", str(fresh.socket)],
        capture_output=True,
        text=True,
    )
    assert json.loads(listed.stdout)[0]["adopted"] is True


def test_watch_refuses_directories_it_cannot_link_from(make_daemon: Any, tmp_path: Path) -> None:
    shm = f"/dev/shm/ckptd-test-{os.getpid()}"
    daemon = make_daemon(extra_args=["--adopt-dirs", f"{tmp_path},{shm}"])
    client = daemon.client("job")
    with pytest.raises(CkptdError, match="own store"):
        ckptd_orbax.directory(client, daemon.root / "job")
    if os.path.exists("/dev/shm") and os.stat("/dev/shm").st_dev != os.stat(daemon.root).st_dev:
        with pytest.raises(CkptdError, match="another filesystem"):
            ckptd_orbax.directory(client, shm)
        assert not os.path.exists(shm)  # refused before anything was created
    assert ckptd_orbax.ensure_local(client) is None  # nothing adopted: a fresh start
    default = ckptd_orbax.directory(client)
    assert default == daemon.root / ".orbax" / "job"
    assert ckptd_orbax.bucket_directory(client) == ""  # no remote tier
    custom = daemon.root.parent / "orbax-elsewhere"
    assert ckptd_orbax.directory(client, custom) == custom
    ckptd_orbax.bucket_directory(client)  # asking where the bucket is changes no watch
    watched = json.loads((daemon.root / ".watched.json").read_text())
    assert watched["job"]["directory"] == str(custom)


def test_an_adopted_file_changed_afterwards_fails_the_step_with_the_reason(
    make_daemon: Any, tmp_path: Path
) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    # The drain is held before it reads a byte: time to modify the source after adoption.
    d: Daemon = remote_daemon(make_daemon, remote, "drain.upload=pause")
    src = tmp_path / "ckpt"
    dcp_like(src)
    client = d.client("job")
    handle = client.adopt(5, src)
    d.wait_failpoint("drain.upload")
    with open(src / "__1_0.distcp", "r+b") as f:  # same size, other bytes: a hard link
        f.write(b"x" * 10)
    d.release("drain.upload")
    with pytest.raises(SaveFailed, match="changed after adoption"):
        handle.wait("durable", timeout=120)
    [row] = client.list()
    assert row.state == "FAILED" and not (tmp_path / "bucket" / "job" / "5").exists()


# -- step-directory layouts: Hugging Face, torchtitan, Orbax ------------------------------


def test_layouts_name_steps_and_finish_them_as_each_framework_does(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    for step in (2, 4):  # as complete as the Trainer ever makes one, commit file included
        (hf / f"checkpoint-{step}").mkdir(parents=True)
        (hf / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
        (hf / f"checkpoint-{step}" / "commit_success.txt").write_text("x")
    assert finished_steps(hf, HF) == []  # only the Trainer's callback says one is done

    tt = tmp_path / "tt"
    for name, done in [("step-10", True), ("step-12", False), ("step-012", True), ("10", True)]:
        (tt / name).mkdir(parents=True)
        (tt / name / "__0_0.distcp").write_bytes(b"data")
        if done:
            (tt / name / ".metadata").write_bytes(b"dcp metadata, renamed into place last")
    (tt / "10" / "commit_success.txt").write_text("x")
    assert [(s, p.name) for s, p, _ in finished_steps(tt, TORCHTITAN)] == [(10, "step-10")]
    assert [(s, p.name) for s, p, _ in finished_steps(tt)] == [(10, "10")]  # Orbax's names

    assert [HF.dir_name(6), TORCHTITAN.dir_name(6), ORBAX.dir_name(6)] == [
        "checkpoint-6",
        "step-6",
        "6",
    ]
    assert [HF.step_of(n) for n in ("checkpoint-6", "checkpoint-06", "checkpoint-", "6")] == [
        6,
        None,
        None,
        None,
    ]
    assert layout_named("") is ORBAX and layout_named("hf") is HF
    with pytest.raises(InvalidArgument, match="unknown step-directory layout"):
        layout_named("megatron")


def hf_like(step_dir: Path, seed: int = 0) -> dict[str, bytes]:
    """A directory shaped like a Hugging Face Trainer checkpoint (random bytes)."""
    rng = np.random.default_rng(seed)
    files = {
        "model.safetensors": rng.bytes(200_000),
        "optimizer.pt": rng.bytes(300_000),
        "rng_state.pth": rng.bytes(1000),
        "trainer_state.json": b'{"global_step": 3}',
    }
    step_dir.mkdir(parents=True)
    for name, data in files.items():
        (step_dir / name).write_bytes(data)
    return files


def ensure_local(client: Any, directory: Path | None, layout: str = "", **kw: Any) -> Any:
    """EnsureLocal into ``directory`` (None: the watched one) named as ``layout`` names steps."""
    where = str(directory) if directory else ""
    req = pb.EnsureLocalRequest(job=client.job, directory=where, layout=layout, **kw)
    return client.connection.ensure_local(req)


def test_hf_checkpoints_come_back_under_the_name_the_trainer_looks_for(
    make_daemon: Any, tmp_path: Path
) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    d: Daemon = remote_daemon(make_daemon, remote)
    client = d.client("job")
    out = tmp_path / "out"
    files = hf_like(out / "checkpoint-3")
    watch = pb.WatchRequest(job="job", directory=str(out), layout="hf")
    assert client.connection.watch(watch).directory == str(out)  # scans at once
    assert client.list() == []  # a checkpoint-N is never adopted by a scan
    assert json.loads((d.root / ".watched.json").read_text())["job"]["layout"] == "hf"
    client.adopt(3, out / "checkpoint-3").wait("durable", timeout=60)

    shutil.rmtree(out / "checkpoint-3")  # the Trainer's save_total_limit
    resp = ensure_local(client, None)  # the watched directory, and its layout
    assert (resp.step, resp.path, resp.linked) == (3, str(out / "checkpoint-3"), True)
    assert sorted(os.listdir(out)) == ["checkpoint-3"]
    for name, data in files.items():
        assert (out / "checkpoint-3" / name).read_bytes() == data
    with pytest.raises(InvalidArgument, match="unknown step-directory layout"):
        ensure_local(client, out, "nemo")

    # The node is lost: the step comes back from the bucket under the Trainer's name.
    d.kill()
    shutil.rmtree(d.root)
    fresh: Daemon = remote_daemon(make_daemon, remote)
    elsewhere = tmp_path / "new-out"
    resp = ensure_local(fresh.client("job"), elsewhere, "hf")
    assert (resp.path, resp.fetched) == (str(elsewhere / "checkpoint-3"), True)
    for name, data in files.items():
        assert (elsewhere / "checkpoint-3" / name).read_bytes() == data

    # `ckptd pull` writes the tree itself at the destination, whole or not at all.
    dest = tmp_path / "pulled" / "checkpoint-3"
    dest.mkdir(parents=True)  # an empty directory is fine
    pull = [CKPTD, "pull", "job", str(dest), "--step", "3", "--remote", remote.url]
    out_ = subprocess.run(pull, capture_output=True, text=True, timeout=120)
    assert out_.returncode == 0, out_.stderr
    assert sorted(os.listdir(dest)) == sorted(files)
    for name, data in files.items():
        assert (dest / name).read_bytes() == data
    assert os.listdir(dest.parent) == ["checkpoint-3"]  # the staging directory is gone
    again = subprocess.run(pull, capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "not empty" in again.stderr


def test_torchtitan_steps_are_adopted_once_dcp_wrote_its_metadata(
    daemon: Daemon, tmp_path: Path
) -> None:
    client = daemon.client("tt")
    folder = tmp_path / "checkpoint"
    files = dcp_like(folder / "step-5")  # .metadata included: DCP finished it
    dcp_like(folder / "step-6")
    metadata = (folder / "step-6" / ".metadata").read_bytes()
    (folder / "step-6" / ".metadata").unlink()  # its data is written, DCP's .metadata not yet
    watch = pb.WatchRequest(job="tt", directory=str(folder), layout="torchtitan")
    client.connection.watch(watch)
    assert [(c.step, c.adopted) for c in client.list()] == [(5, True)]
    (folder / "step-6" / ".metadata").write_bytes(metadata)
    client.connection.watch(watch)  # scans again
    assert sorted(c.step for c in client.list()) == [5, 6]

    shutil.rmtree(folder / "step-5")
    resp = ensure_local(client, None, step=5)
    assert resp.path == str(folder / "step-5")
    for name, data in files.items():
        assert (folder / "step-5" / name).read_bytes() == data
    client.connection.watch(watch)  # what was put back is not adopted again
    assert sorted(c.step for c in client.list()) == [5, 6]


def test_put_back_copies_into_another_filesystem(tmp_path: Path) -> None:
    other = Path(tempfile.mkdtemp(prefix="ckptd-test-", dir="/dev/shm"))
    try:
        if os.stat(other).st_dev == os.stat(tmp_path).st_dev:
            pytest.skip("/dev/shm is on the same filesystem as the test's tmp dir here")
        src = tmp_path / "src"
        files = hf_like(src)
        store = tmp_path / "store"
        store.mkdir()
        manifest = Manifest(
            job="job", step=3, node="n", world_size=1, created_unix=0.0,
            ranks=link_tree(src, store), kind=KIND_DIRECTORY,
        )  # fmt: skip
        fd = os.open(other, os.O_RDONLY | os.O_DIRECTORY)
        try:
            put_back(store, manifest, fd, "checkpoint-3")
        finally:
            os.close(fd)
        for name, data in files.items():
            assert (other / "checkpoint-3" / name).read_bytes() == data
        assert sorted(os.listdir(other)) == ["checkpoint-3"]
    finally:
        shutil.rmtree(other, ignore_errors=True)
