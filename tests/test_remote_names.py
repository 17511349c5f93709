"""Names from the bucket never reach a local path unchecked (issue 12).

A remote step whose manifest names a file outside its step directory (an absolute
path, ``../`` escapes), whose manifest describes another step than the key it was
read from, or whose key holds a name that is not valid, is never fetched: restore
serves the older good step, the bad one is reported unusable, the daemon stays up,
and nothing is created outside its root. Plus the O_NOFOLLOW opens of the fetch
path. The validator's own table of cases is in test_manifest_check.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptd.client import CheckpointCorrupt, CheckpointNotFound
from ckptd.client import orbax as ckptd_orbax
from ckptd.core.manifest import DATA_BY_STEP
from ckptd.daemon.app.launcher import ckptd_command
from ckptd.daemon.files import open_dir_beneath
from ckptd.daemon.remote import index
from ckptd.daemon.remote.backends import open_remote
from ckptd.daemon.remote.layout import data_prefix, manifest_key, marker_key
from ckptd.daemon.remote.layout import spread as spread_of
from ckptd.proto import ckptd_pb2 as pb

from .conftest import Daemon, RemoteTarget
from .helpers import state_for
from .test_adopt import dcp_like
from .test_remote_tier import remote_daemon, s3_target
from .test_retention_tier import settled

MIB = 1
NODE = "test-node"
Edit = Callable[[dict[str, Any]], None]


def set_field(path: str, value: Any) -> Edit:
    """An edit that sets ``ranks.0.file``-style ``path`` in a manifest dict."""

    def edit(raw: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        at: Any = raw
        for p in parents:
            at = at[int(p)] if isinstance(at, list) else at[p]
        at[int(last) if isinstance(at, list) else last] = value

    return edit


# -- O_NOFOLLOW in the fetch path ---------------------------------------------------------
def test_open_dir_beneath_refuses_a_planted_symlink(tmp_path: Path) -> None:
    root, outside = tmp_path / "staging", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "files").symlink_to(outside)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError):
            open_dir_beneath(fd, "files/default", make=True)
        inner = open_dir_beneath(fd, "other/deeper", make=True)
        os.close(inner)
    finally:
        os.close(fd)
    assert list(outside.iterdir()) == []
    assert (root / "other" / "deeper").is_dir()


def test_download_never_writes_through_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "bucket" / "j").mkdir(parents=True)
    (tmp_path / "bucket" / "j" / "obj").write_bytes(b"x" * 100)
    dest, victim = tmp_path / "dest", tmp_path / "victim"
    dest.mkdir()
    victim.write_bytes(b"keep")
    (dest / "obj").symlink_to(victim)
    (dest / "dangling").symlink_to(tmp_path / "created-through-link")

    async def main() -> None:
        r = open_remote(f"file://{tmp_path}/bucket", "", 2**20, 2)
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name in ("obj", "dangling"):
                with pytest.raises(FileExistsError):
                    await r.download("j/obj", name, 100, dir_fd=fd)
            assert await r.download("j/obj", "fresh", 100, dir_fd=fd) > 0
        finally:
            os.close(fd)
            await r.close()

    asyncio.run(main())
    assert victim.read_bytes() == b"keep"
    assert not (tmp_path / "created-through-link").exists()
    assert (dest / "fresh").read_bytes() == b"x" * 100


# -- a real daemon and a real bucket ----------------------------------------------------
def _plant(
    remote: RemoteTarget,
    job: str,
    src: int,
    step: int,
    edit: Edit | None = None,
    node: str = NODE,
    adopted: bool = False,
    to_job: str = "",
    old_layout: bool = False,
) -> None:
    """Copy step ``src``'s objects to ``step`` (as ``node``, of ``to_job`` if given) with
    its manifest edited, marker last, and (a valid ``node``'s) in the node's step index:
    a step that looks complete to every reader. A running daemon keeps the index it
    read: restart it to make it read the planted one. ``old_layout``: as a ckptd before
    the spread layout wrote it (rank files beside the manifest, no ``data_layout``)."""
    dst = to_job or job

    async def body(r: Any) -> None:
        raw = json.loads(await r.get_bytes(manifest_key(job, src, NODE, adopted)))
        layout = raw.get("data_layout", DATA_BY_STEP)
        if old_layout:
            del raw["data_layout"]
        to = DATA_BY_STEP if old_layout else layout
        if not adopted:
            for rank in raw["ranks"]:
                timeline = raw.get("timeline", 0)
                src_prefix = data_prefix(job, src, NODE, layout, timeline)
                data = await r.get_bytes(f"{src_prefix}/{rank['file']}")
                # The name as given (a test's bad node name included), never checked.
                dst_prefix = data_prefix(dst, step, node, to, timeline)
                await r.put_bytes(f"{dst_prefix}/{rank['file']}", data)
        raw.update(job=dst, step=step, node=node)
        if edit is not None:
            edit(raw)
        await r.put_bytes(manifest_key(dst, step, node, adopted), json.dumps(raw).encode())
        marker = await r.get_bytes(marker_key(job, src, NODE, adopted))
        await r.put_bytes(marker_key(dst, step, node, adopted), marker)
        if node != NODE:
            return  # not a name the daemon reads an index of
        try:
            entries = index.decode(await r.get_bytes(index.index_key(dst, node)))
        except FileNotFoundError:
            entries = {}
        entries[step] = index.Entry(step, adopted, data_layout=to)
        await r.put_bytes(index.index_key(dst, node), index.encode(dst, node, entries))

    remote.run(body)


def _file_named(name: str) -> Edit:
    """Every rank file (and its shards) renamed to ``name``."""

    def edit(raw: dict[str, Any]) -> None:
        for r in raw["ranks"]:
            r["file"] = name
        for s in raw["shards"] if isinstance(raw["shards"], list) else ():  # version 1
            s["file"] = name

    return edit


def _escape(outside: Path, name: str) -> str:
    """A relative name that climbs out of any directory under / into ``outside``."""
    return "../" * 40 + str(outside / name).lstrip("/")


def _good_steps(make_daemon: Any, remote: RemoteTarget, job: str) -> tuple[Daemon, Any]:
    daemon = remote_daemon(make_daemon, remote)
    client = daemon.client(job)
    for step in (1, 2):
        client.save(step, state_for(step, MIB), metadata={"step": step}).wait("durable", 120)
    return daemon, client


def _restored(client: Any) -> tuple[int, bool]:
    tree, meta = client.restore()
    step = meta["step"]
    same = tree["w3"].tobytes() == state_for(step, MIB)["w3"].tobytes()
    del tree
    return step, same


def _nothing_escaped(tmp_path: Path, daemon: Daemon, outside: Path) -> None:
    assert list(outside.iterdir()) == []
    assert [p for p in tmp_path.rglob("*evil*")] == []
    assert list((daemon.root / ".cache").iterdir()) == []  # the aborted fetch is gone
    assert daemon.running()
    assert daemon.status().version  # and still answering


def _reported_unusable(daemon: Daemon, client: Any, job: str, step: int, why: str) -> None:
    row = next(c for c in client.list() if c.step == step)
    assert "unusable" in row.error and why in row.error, row.error
    [event] = daemon.events_of(pb.STEP_EVENT_SET_ASIDE, job, step)
    assert event.attributes["tier"] == "remote" and why in event.detail
    with pytest.raises(CheckpointCorrupt, match="cannot be restored"):
        client.restore(step=step)


CASES: dict[str, tuple[Callable[[Path], Edit], str]] = {
    "absolute": (lambda out: _file_named(str(out / "evil-abs")), "ranks[0].file"),
    "dotdot": (lambda out: _file_named(_escape(out, "evil-dotdot")), "ranks[0].file"),
    "other-step": (lambda out: set_field("step", 2), "not the step it is filed under"),
    "other-job": (lambda out: set_field("job", "other"), "not the step it is filed under"),
    "other-node": (lambda out: set_field("node", "node-9"), "not the step it is filed under"),
    "garbage": (lambda out: set_field("ranks", "x"), "not a valid manifest"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_remote_manifest_is_unusable_and_the_older_step_served(
    make_daemon: Any, tmp_path: Path, case: str
) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon, client = _good_steps(make_daemon, remote, "names")
    outside = tmp_path / "outside"
    outside.mkdir()
    edit, why = CASES[case]
    _plant(remote, "names", 2, 3, edit(outside))
    daemon.stop()  # the restarted daemon reads the node's index, planted step and all
    daemon.start()
    assert _restored(client) == (2, True)
    _reported_unusable(daemon, client, "names", 3, why)
    assert _restored(client) == (2, True)  # and every later restore too
    assert not (daemon.root / "names" / "3").exists()
    _nothing_escaped(tmp_path, daemon, outside)


def test_a_job_with_only_a_bad_step_is_not_found(make_daemon: Any, tmp_path: Path) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon, _ = _good_steps(make_daemon, remote, "names")
    outside = tmp_path / "outside"
    outside.mkdir()

    _plant(remote, "names", 2, 3, _file_named(_escape(outside, "evil-lonely")), to_job="lonely")
    lonely = daemon.client("lonely")
    with pytest.raises(CheckpointNotFound):
        lonely.restore()
    _reported_unusable(daemon, lonely, "lonely", 3, "ranks[0].file")
    _nothing_escaped(tmp_path, daemon, outside)
    verify = subprocess.run(
        [*ckptd_command(), "verify", "--root", str(daemon.root), "--remote", remote.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert "CORRUPT  remote lonely/3" in verify.stdout, verify.stdout
    assert "OK       remote names/2" in verify.stdout, verify.stdout


def test_unsafe_local_manifests_are_set_aside_at_start(make_daemon: Any, tmp_path: Path) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon, client = _good_steps(make_daemon, remote, "names")
    outside = tmp_path / "outside"
    outside.mkdir()
    daemon.stop()
    two = daemon.root / "names" / "2" / "manifest.json"
    raw = json.loads(two.read_text())
    _file_named(_escape(outside, "evil-local"))(raw)
    two.write_text(json.dumps(raw))
    # Step 1's manifest: intact bytes, but reached through a symlink (never followed).
    one = daemon.root / "names" / "1" / "manifest.json"
    kept = tmp_path / "kept-manifest.json"
    one.rename(kept)
    one.symlink_to(kept)
    daemon.start()
    assert not (daemon.root / "names" / "2").exists()
    assert not (daemon.root / "names" / "1").exists()
    assert _restored(client) == (2, True)  # fetched again from the bucket
    tree, meta = client.restore(step=1)
    assert meta["step"] == 1 and tree["w3"].tobytes() == state_for(1, MIB)["w3"].tobytes()
    del tree
    assert list(outside.iterdir()) == [] and daemon.running()


def test_listed_keys_with_bad_names_never_become_steps(make_daemon: Any, tmp_path: Path) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon, client = _good_steps(make_daemon, remote, "names")
    # Step 5: whole and consistent, but its node's name is not a valid one.
    _plant(remote, "names", 2, 5, node="a..b")

    async def junk(r: Any) -> None:
        marker = json.dumps({"created_unix": "soon", "metrics": [1]}).encode()
        for key in (
            "bad..job/1/_complete/test-node",  # a job no client could name
            "names/²/_complete/test-node",  # isdigit() but not int()
            "names/007/_complete/test-node",
            "names/8/_complete/.hidden",
            "junk/1/_complete/test-node",  # a valid key with a marker of the wrong types
            "bad..job/1/_pinned",
        ):
            await r.put_bytes(key, marker)

    remote.run(junk)
    after = daemon.events()[-1].seq
    assert _restored(client) == (2, True)
    assert [c.step for c in client.list()] == [2, 1]
    # A restart reads the node's index of each job it holds: still up, nothing bad
    # discovered (and nothing of the other jobs: their keys are never listed).
    daemon.stop()
    daemon.start()
    assert _restored(client) == (2, True)
    found = [(e.job, e.step) for e in daemon.events(after=after)]
    assert ("bad..job", 1) not in found and ("names", 5) not in found, found
    assert [c.step for c in client.list()] == [2, 1]
    assert daemon.running()


def test_adopted_step_escaping_its_tree_is_never_put_back(make_daemon: Any, tmp_path: Path) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    daemon = remote_daemon(make_daemon, remote)
    client = daemon.client("tree")
    files = dcp_like(tmp_path / "dcp" / "100")
    client.adopt(100, tmp_path / "dcp" / "100").wait("durable", timeout=60)
    outside = tmp_path / "outside"
    outside.mkdir()
    escape = set_field("ranks.0.file", "files/" + _escape(outside, "evil"))
    _plant(remote, "tree", 100, 101, escape, adopted=True)
    daemon.kill()  # a wiped node: both steps only in the bucket
    fresh = remote_daemon(make_daemon, remote)
    client = fresh.client("tree")
    target = tmp_path / "restored"
    # 101 is chosen first, found unusable, and the same call goes on to 100.
    assert ckptd_orbax.ensure_local(client, directory=target) == 100
    for name, data in files.items():
        assert (target / "100" / name).read_bytes() == data
    assert not (target / "101").exists()
    _reported_unusable(fresh, client, "tree", 101, "ranks[0].file")
    _nothing_escaped(tmp_path, fresh, outside)


def test_s3_bad_steps_fall_back_on_a_wiped_node(
    make_daemon: Any, s3_server: Any, tmp_path: Path
) -> None:
    remote = s3_target(s3_server, f"ckptd-names-{os.getpid()}")
    daemon, _ = _good_steps(make_daemon, remote, "names")
    outside = tmp_path / "outside"
    outside.mkdir()
    _plant(remote, "names", 2, 3, _file_named(_escape(outside, "evil-s3")))
    _plant(remote, "names", 2, 4, _file_named(str(outside / "evil-s3-abs")))
    _plant(remote, "names", 2, 5, set_field("step", 2))
    _plant(remote, "names", 2, 6, node="a..b")
    daemon.kill()
    # Remote retention counts the bad steps until a fetch finds them out: keep the good
    # ones in the bucket for this test (see the report on issue 12).
    fresh = remote_daemon(make_daemon, remote, extra_args=["--retention-remote", "KeepLatest(10)"])
    client = fresh.client("names")
    assert _restored(client) == (2, True)  # fetched: the local tier was wiped
    for step, why in ((3, "ranks[0].file"), (4, "ranks[0].file"), (5, "filed under")):
        _reported_unusable(fresh, client, "names", step, why)
    assert 6 not in [c.step for c in client.list()]
    _nothing_escaped(tmp_path, fresh, outside)


def test_s3_a_bucket_of_the_previous_layout_still_restores(
    make_daemon: Any, s3_server: Any
) -> None:
    """The upgrade path: steps a ckptd before the spread layout drained (rank files
    beside the manifest, no ``data_layout``) restore on a wiped node, bit-exact, beside
    steps of the new layout; remote retention removes either kind whole."""
    remote = s3_target(s3_server, f"ckptd-layout-{os.getpid()}")
    daemon, _ = _good_steps(make_daemon, remote, "names")  # steps 1 and 2, spread
    spread = f"names/_data/{spread_of(NODE)}/{NODE}/"
    assert {k.split("/")[4] for k in remote.object_keys() if k.startswith(spread)} == {"1.0", "2.0"}
    for step in (3, 4):
        _plant(remote, "names", 2, step, old_layout=True)
    keys = remote.object_keys()
    assert f"names/4/{NODE}/rank-00000.safetensors" in keys
    assert not any(k.startswith(f"{spread}4") for k in keys)
    daemon.kill()
    # KeepLatest(1): the restarted daemon drops 1, 2 (spread) and 3 (the old layout).
    fresh = remote_daemon(make_daemon, remote, extra_args=["--retention-remote", "KeepLatest(1)"])
    client = fresh.client("names")
    tree, meta = client.restore()  # the local tier was wiped: from the bucket
    assert meta["step"] == 2  # planted from step 2's objects
    assert tree["w3"].tobytes() == state_for(2, MIB)["w3"].tobytes()
    assert (fresh.root / "names" / "4" / "manifest.json").exists()
    del tree
    settled(client, [4], [4])
    # The objects go after the steps left the catalog: poll the bucket for them.
    want = {f"names/4/_complete/{NODE}", f"names/4/{NODE}/manifest.json",
            f"names/4/{NODE}/rank-00000.safetensors", f"names/_index/{NODE}.json"}  # fmt: skip
    deadline = time.monotonic() + 60
    while set(remote.object_keys()) != want:
        assert time.monotonic() < deadline, remote.object_keys()
        time.sleep(0.1)
