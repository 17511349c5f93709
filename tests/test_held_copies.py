"""A save that replaces a step of an earlier timeline never takes bytes that kept steps
of that timeline read (daemon/local/held.py, daemon/remote/held.py).

Incremental steps reference their holders by number on their own history; a rerun
under a reused job name, or a rollback, saves a new step under such a number. The
old copy leaves every listing, as it would without incremental saves, but its files
stay, held, in each tier where a step still reads them, and go with the last one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from ckptd.core.manifest import MANIFEST
from ckptd.daemon.local.held import HeldCopies
from ckptd.daemon.remote import index
from ckptd.proto import ckptd_pb2 as pb

from .conftest import CKPTD, Daemon, RemoteTarget
from .test_incremental import (
    assert_same,
    incremental_requests,  # noqa: F401  (the autouse fixture: numpy saves go incremental)
    lora_state,
    manifest_of,
    save_steps,
)
from .test_remote_tier import remote_daemon, s3_target, wait_until

NO_MEMORY = ["--memory-tier-steps", "0"]
"""Restores come from the disk: the paths that read holders' files."""


def _two_runs(d: Daemon, job: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run A saves 0..40 (frozen weights: 10..40 read step 0's file) and pins 40; run B,
    a rerun under the same name, saves 0 and 10. The states each saved."""
    a = d.client(job)
    older = save_steps(a, lora_state(), range(0, 50, 10))
    assert manifest_of(d, job, 40).holders() == {0}
    a.pin(40)
    b = d.client(job)  # from scratch: a new timeline, replacing A's 0 and 10
    newer = save_steps(b, lora_state(), range(0, 20, 10))
    return older, newer


def _verify(args: list[str], env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [CKPTD, "verify", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_a_reused_name_keeps_the_older_runs_pinned_step_and_the_bytes_it_reads(
    make_daemon: Any,
) -> None:
    d: Daemon = make_daemon(extra_args=NO_MEMORY)
    older, newer = _two_runs(d, "reused")
    client = d.client("reused")
    got, _ = client.restore()
    assert_same(got, newer[-1])  # the new run's newest
    for shared_memory in (True, False):  # assembled by the daemon, or mapped by the client
        got, _ = client.restore(40, shared_memory=shared_memory)
        assert_same(got, older[-1])
    rows = {c.step: c for c in client.list()}
    assert rows[40].pinned and rows[40].abandoned and rows[40].timeline == 0
    assert (rows[0].timeline, rows[10].timeline) == (1, 1)  # A's 0 and 10 were replaced
    # A's step 0 is out of view, held for the steps that read it (A's 10, read by
    # none, went by the local policy before B's 10 came).
    assert 0 in [e.step for e in d.events_of(pb.STEP_EVENT_REPLACED, "reused")]
    assert [p.name for p in (d.root / ".held" / "reused").iterdir()] == ["0.0"]
    assert not d.events_of(pb.STEP_EVENT_SET_ASIDE, "reused")
    report = _verify(["reused", "--root", str(d.root), "--local-only"])
    assert "reused/40" in report and "CORRUPT" not in report, report


def test_a_rollback_holds_the_replaced_step_for_the_abandoned_step_that_reads_it(
    make_daemon: Any,
) -> None:
    d: Daemon = make_daemon(extra_args=NO_MEMORY)
    client = d.client("redo")
    state = lora_state()
    saved = save_steps(client, state, range(1, 3))
    assert manifest_of(d, "redo", 2).holders() == {1}
    other = {k: v + 7 for k, v in state.items()}
    client.save(1, other).wait("local", timeout=60)  # below the newest: a new timeline
    got, _ = client.restore()
    assert_same(got, other)
    got, _ = client.restore(2)  # abandoned, kept by its timeline's policy: whole
    assert_same(got, saved[1])
    assert (d.root / ".held" / "redo" / "1.0" / MANIFEST).is_file()
    assert not d.events_of(pb.STEP_EVENT_SET_ASIDE, "redo")
    # Restarted, the daemon finds its held copy again.
    assert d.stop() == 0
    d.start()
    got, _ = d.client("redo").restore(2, shared_memory=False)
    assert_same(got, saved[1])


def test_a_holder_replaced_while_a_save_reads_it_is_held_once_that_save_is_written(
    make_daemon: Any,
) -> None:
    """Step 2 (base: step 1) is still being written when a rollback's step 1 arrives:
    the replacement waits for step 2, then holds the old step 1 for it."""
    d: Daemon = make_daemon(extra_args=NO_MEMORY, env={"CKPTD_FAILPOINTS": "write.increment=pause"})
    client = d.client("race")
    state = lora_state()
    client.save(1, state).wait("local", timeout=60)
    state["lora.0"] = state["lora.0"] + 1
    second = client.save(2, state)  # decided against step 1, paused before writing
    d.wait_failpoint("write.increment")
    other = {k: v + 7 for k, v in state.items()}
    first_again = client.save(1, other)  # a new timeline: replaces step 1
    d.release("write.increment")
    second.wait("local", timeout=60)
    first_again.wait("local", timeout=60)
    got, _ = client.restore()
    assert_same(got, other)
    got, _ = client.restore(2)
    assert_same(got, state)
    assert not d.events_of(pb.STEP_EVENT_SET_ASIDE, "race")


def test_a_reused_names_older_run_stays_in_the_bucket_and_restores_after_a_node_loss(
    make_daemon: Any, s3_server: Any, tmp_path: Any
) -> None:
    remote: RemoteTarget = s3_target(s3_server, "ckptd-held-copies")
    d = remote_daemon(make_daemon, remote, extra_args=NO_MEMORY)
    a = d.client("reused")
    older = save_steps(a, lora_state(), range(0, 50, 10))
    a.wait_until_finished("durable", timeout=120)
    a.pin(40)
    b = d.client("reused")
    newer = save_steps(b, lora_state(), range(0, 20, 10))
    b.wait_until_finished("durable", timeout=120)
    in_bucket = {c.step: c for c in b.list() if "REMOTE" in c.tiers}
    assert {0, 10, 40} <= set(in_bucket) and in_bucket[40].abandoned
    assert in_bucket[0].timeline == 1
    # The older run's pinned step leaves the disk once unpinned (the bucket holds it),
    # and the held copy of A's 0 with it; the bucket's stays for the bucket's copy.
    b.unpin(40)
    wait_until(
        lambda: not (d.root / ".held" / "reused" / "0.0").exists(),
        what="the local held copy deleted once no local step reads it",
    )
    assert d.stop() == 0
    shutil.rmtree(d.root)  # the node's disk is lost
    fresh = remote_daemon(make_daemon, remote, root=d.root, extra_args=NO_MEMORY)
    client = fresh.client("reused")
    got, _ = client.restore()
    assert_same(got, newer[-1])
    got, _ = client.restore(40)  # brings the held copy of A's 0 from the bucket
    assert_same(got, older[-1])
    assert not fresh.events_of(pb.STEP_EVENT_SET_ASIDE, "reused")
    report = _verify(["reused", "--remote", remote.url, "--remote-only"], remote.env)
    assert "CORRUPT" not in report and "reused/40/" in report, report
    dest = tmp_path / "pulled"
    pull = subprocess.run(
        [CKPTD, "pull", "reused", str(dest), "--step", "40", "--remote", remote.url],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **remote.env},
    )
    assert pull.returncode == 0, pull.stderr
    tensors = _read_safetensors(dest / "rank-00000.safetensors")
    assert_same(tensors, older[-1])


def _read_safetensors(path: Any) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return dict(load_file(str(path)))


# -- the parts, alone ---------------------------------------------------------------
def test_the_index_records_held_copies_and_skips_what_it_cannot_read() -> None:
    entries = {7: index.Entry(7, timeline=1, forks=((1, 5),), holders=[3], data_layout=3)}
    raw = index.encode("j", "n", entries, {(3, 0): 3, (5, 0): 2})
    got, held = index.decode_all(raw)
    assert got == entries and held == {(3, 0): 3, (5, 0): 2}
    assert index.decode(index.encode("j", "n", entries)) == entries  # no "held": none
    body = json.loads(raw)
    body["held"] += [[1, 2], [-1, 0, 3], [1, 0, 9], "x", [2**70, 0, 3], [True, 0, 3]]
    assert index.decode_all(json.dumps(body).encode())[1] == held  # bucket content: skipped
    old = json.loads(raw)
    del old["steps"][0]["data_layout"]  # an entry written before the field
    assert index.decode(json.dumps(old).encode())[7].data_layout == 2


def test_held_copies_are_found_again_and_dropped(tmp_path: Path) -> None:
    step_dir = tmp_path / "j" / "4"
    step_dir.mkdir(parents=True)
    (step_dir / MANIFEST).write_text("{}")
    copies = HeldCopies(tmp_path)
    copies.keep(step_dir, "j", 4, 1)
    assert not step_dir.exists() and (tmp_path / ".held" / "j" / "4.1" / MANIFEST).is_file()
    (tmp_path / ".held" / "j" / "junk").mkdir()  # not one ckptd made: removed at load
    (tmp_path / ".held" / "j" / "5.0").mkdir()  # no manifest: a copy cut short, removed
    again = HeldCopies(tmp_path)
    assert again.load() == {("j", 4, 1)} and again.has("j", 4, 1)
    assert sorted(p.name for p in (tmp_path / ".held" / "j").iterdir()) == ["4.1"]
    assert again.drop([("j", 4, 1), ("j", 9, 0)]) == [("j", 4, 1)]
    assert not (tmp_path / ".held" / "j" / "4.1").exists() and not again.keys()
