"""The Hugging Face Trainer through ckptd.client.hf: real Trainer loops against real daemons.

A tiny GPT-2 (built from a config) trains on CPU in subprocesses
(tests/frameworks/hf_worker.py) with ``save_steps=2`` and ``save_total_limit=2``;
the ckptd callback adopts each checkpoint into a daemon with a ``file://``
bucket. Each run is SIGKILLed (a save cut short, or right after an adoption),
resumed through ckptd, with the node's disk intact or wiped, and its final
model, optimizer and scheduler state compared bit for bit with an uninterrupted
run in the same test (HF's own resume is checked to be exact first).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ckptd.client import SaveHandle
from ckptd.core.checksum import of_file as crc32c_file
from ckptd.proto import ckptd_pb2 as pb

from ..conftest import CKPTD, Daemon, RemoteTarget
from ..test_remote_tier import remote_daemon

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
JOB = "hf-run"


def start(*args: str, world: int = 1) -> list[subprocess.Popen[str]]:
    """Start the worker as ``world`` processes (DDP over gloo when 2)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same math in every run
    if world > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    procs = []
    for rank in range(world):
        ranked = env | ({"RANK": str(rank), "LOCAL_RANK": str(rank)} if world > 1 else {})
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.frameworks.hf_worker", *args],
                cwd=REPO,
                env=ranked,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def finish(procs: list[subprocess.Popen[str]], rc: int = 0) -> list[dict[str, Any]]:
    """Wait for the processes; each must exit with ``rc``; their JSON summaries."""
    got = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == rc, f"exit {p.returncode}, want {rc}:\n{out[-3000:]}{err[-6000:]}"
        lines = out.strip().splitlines()
        got.append(json.loads(lines[-1]) if rc == 0 else {})
    return got


def wait_for(done: Any, procs: list[subprocess.Popen[str]], timeout: float = 240.0) -> None:
    """Poll ``done()`` while the processes run (one that exits early fails the test)."""
    deadline = time.monotonic() + timeout
    while not done():
        for p in procs:
            if p.poll() is not None:
                finish([p])  # shows its output
                pytest.fail(f"a worker exited with {p.returncode} before it was killed")
        assert time.monotonic() < deadline, "the workers never got there"
        time.sleep(0.1)


def run(*args: str, world: int = 1, rc: int = 0) -> list[dict[str, Any]]:
    return finish(start(*args, world=world), rc)


def flat(x: Any, path: str = "") -> dict[str, Any]:
    if isinstance(x, dict):
        return {k: v for key, item in x.items() for k, v in flat(item, f"{path}/{key}").items()}
    if isinstance(x, list | tuple):
        return {k: v for i, item in enumerate(x) for k, v in flat(item, f"{path}/{i}").items()}
    return {path: x}


def assert_identical(got_path: Path, want_path: Path) -> None:
    """Model, optimizer and scheduler state bit-identical (every tensor, every number)."""
    got = flat(torch.load(got_path, weights_only=False))
    want = flat(torch.load(want_path, weights_only=False))
    assert got.keys() == want.keys()
    differ = [
        k
        for k in want
        if not (
            torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k]
        )
    ]
    assert not differ, f"{len(differ)} of {len(want)} entries differ: {differ[:5]}"
    assert sum(isinstance(v, torch.Tensor) for v in want.values()) > 50  # compared something


def crcs(tree: Path) -> dict[str, int]:
    return {
        str(p.relative_to(tree)): crc32c_file(p) for p in sorted(tree.rglob("*")) if p.is_file()
    }


def adopted_steps(d: Daemon) -> list[int]:
    return sorted(c.step for c in d.client(JOB).list() if c.adopted)


def file_bucket(tmp_path: Path, name: str = "bucket") -> RemoteTarget:
    return RemoteTarget("file", f"file://{tmp_path}/{name}", {})


def test_kill_mid_save_resumes_exactly_from_ckptd_with_disk_intact_or_lost(
    make_daemon: Any, tmp_path: Path
) -> None:
    d: Daemon = remote_daemon(make_daemon, file_bucket(tmp_path))
    out = tmp_path / "out"
    # The watch knows the Trainer's names, and that only the Trainer says a step is done.
    d.client(JOB).connection.watch(pb.WatchRequest(job=JOB, directory=str(out), layout="hf"))
    ref = start("--out", str(tmp_path / "ref"), "--result", str(tmp_path / "ref.pt"),
                "--save-total-limit", "0", "--native-check", "4")  # fmt: skip
    # Killed inside the save of step 6: model written, optimizer and trainer state not.
    killed = start("--out", str(out), "--result", str(tmp_path / "never.pt"), "--job", JOB,
                   "--socket", str(d.socket), "--resume", "ckptd",
                   "--kill-mid-save", "6")  # fmt: skip
    finish(killed, rc=-9)
    finish(ref)
    # Plain HF resumes exactly by itself: what ckptd's resumes are held to is sound.
    assert_identical(tmp_path / "ref.pt.native", tmp_path / "ref.pt")

    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not (out / "checkpoint-6" / "trainer_state.json").exists()  # half-written
    # Watch scans (synchronously) again: the half-written checkpoint-6 is never adopted.
    d.client(JOB).connection.watch(pb.WatchRequest(job=JOB, directory=str(out), layout="hf"))
    assert adopted_steps(d) == [2, 4]
    written4 = crcs(out / "checkpoint-4")
    SaveHandle(d.client(JOB), 4).wait("durable", timeout=120)
    # `ckptd pull` gives back the tree exactly as the Trainer wrote it.
    dest = tmp_path / "pulled" / "checkpoint-4"
    pull = [CKPTD, "pull", JOB, str(dest), "--step", "4", "--remote", f"file://{tmp_path}/bucket"]
    subprocess.run(pull, check=True, capture_output=True, timeout=120)
    assert crcs(dest) == written4
    assert os.listdir(dest.parent) == ["checkpoint-4"]  # no staging left, no manifest

    # The node is lost: a fresh daemon and an empty output_dir on a bucket as it was
    # at the kill (a copy, so the intact-disk resume below can run beside it). Not the
    # node name's claim: it is the live daemon d's, and on a lost node its daemon is gone.
    shutil.copytree(
        tmp_path / "bucket", tmp_path / "bucket2", ignore=shutil.ignore_patterns("_nodes")
    )
    fresh: Daemon = remote_daemon(make_daemon, file_bucket(tmp_path, "bucket2"))
    lost = start("--out", str(tmp_path / "out2"), "--result", str(tmp_path / "lost.pt"),
                 "--job", JOB, "--socket", str(fresh.socket), "--resume", "ckptd-true")  # fmt: skip
    # Same node, disk intact (a half-written checkpoint-6 beside it): resume(trainer)'s path.
    (intact,) = run("--out", str(out), "--result", str(tmp_path / "intact.pt"), "--job", JOB,
                    "--socket", str(d.socket), "--resume", "ckptd")  # fmt: skip
    (after_loss,) = finish(lost)

    assert intact["resumed_from"] == str(out / "checkpoint-4")
    assert intact["adopted"] == [6, 8]
    assert_identical(tmp_path / "intact.pt", tmp_path / "ref.pt")
    assert after_loss["resumed_from"] == "True"  # resume_from_checkpoint=True found it
    assert after_loss["adopted"] == [6, 8]
    assert_identical(tmp_path / "lost.pt", tmp_path / "ref.pt")
    # Step 4 and, as save_total_limit=2 kept it beside 4 on the lost disk, step 2.
    assert sorted(e.step for e in fresh.events_of(pb.STEP_EVENT_FETCHED, JOB)) == [2, 4]

    # save_total_limit=2 is also the job's retention in ckptd's tiers: what the
    # Trainer rotated out of output_dir leaves ckptd too, once no reader holds it (the
    # resume above read steps 2 and 4: they stay "in-use" for two minutes).
    assert intact["on_disk"] == ["checkpoint-6", "checkpoint-8"]
    rows = {c.step: c for c in d.client(JOB).list() if c.tiers}
    assert rows[8].remote_reasons == ("latest", "newest") and rows[6].remote_reasons == ("latest",)
    for step in set(rows) - {6, 8}:
        assert rows[step].local_reasons == rows[step].remote_reasons == ("in-use",), step


def test_two_processes_resume_exactly_after_node_loss(make_daemon: Any, tmp_path: Path) -> None:
    """DDP over gloo, one node: rank 0 writes the model, optimizer and trainer state,
    every rank its rng_state_<rank>.pth; rank 0 adopts the whole directory once all
    are in. Killed right after step 4 reached the bucket, the node's disk wiped."""
    d: Daemon = remote_daemon(make_daemon, file_bucket(tmp_path))
    out = tmp_path / "out"
    ref = start("--out", str(tmp_path / "ref"), "--result", str(tmp_path / "ref{rank}.pt"),
                "--save-total-limit", "0", "--native-check", "4", world=2)  # fmt: skip
    killed = start("--out", str(out), "--result", str(tmp_path / "never.pt"), "--job", JOB,
                   "--socket", str(d.socket), "--resume", "ckptd", "--kill-after", "4",
                   world=2)  # fmt: skip
    ready = [tmp_path / f"never.pt.ready.{rank}" for rank in (0, 1)]
    wait_for(lambda: all(r.exists() for r in ready), killed)  # step 4 is in the bucket
    for p in killed:
        p.kill()
    finish(killed, rc=-9)
    finish(ref)
    for rank in (0, 1):
        assert_identical(tmp_path / f"ref{rank}.pt.native", tmp_path / f"ref{rank}.pt")

    assert adopted_steps(d) == [2, 4]
    rows = {c.step: c for c in d.client(JOB).list()}
    assert "REMOTE" in rows[4].tiers
    assert rows[4].metrics is not None and "loss" in rows[4].metrics  # what the Trainer logged
    bucket4 = tmp_path / "bucket" / JOB / "4"
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "optimizer.pt"} <= set(
        os.listdir(bucket4)
    )
    assert crcs(bucket4) == crcs(out / "checkpoint-4")  # byte-identical in the bucket

    d.kill()
    shutil.rmtree(d.root)
    shutil.rmtree(out)
    fresh: Daemon = remote_daemon(make_daemon, file_bucket(tmp_path))
    resumed = run("--out", str(out), "--result", str(tmp_path / "resumed{rank}.pt"), "--job",
                  JOB, "--socket", str(fresh.socket), "--resume", "ckptd", world=2)  # fmt: skip
    assert [r["resumed_from"] for r in resumed] == [str(out / "checkpoint-4")] * 2
    assert [r["adopted"] for r in resumed] == [[6, 8], []]  # rank 0 adopts for the node
    for rank in (0, 1):
        assert_identical(tmp_path / f"resumed{rank}.pt", tmp_path / f"ref{rank}.pt")
    # Step 4, and step 2, which save_total_limit=2 kept beside it.
    assert sorted(e.step for e in fresh.events_of(pb.STEP_EVENT_FETCHED, JOB)) == [2, 4]


def test_best_checkpoint_comes_back_after_node_loss(make_daemon: Any, tmp_path: Path) -> None:
    """``load_best_model_at_end`` with the best checkpoint an old one: after the node
    is lost, resume() brings back the best and what save_total_limit keeps beside the
    resumed step, so the run ends with the best model, as the uninterrupted run does."""
    d: Daemon = remote_daemon(make_daemon, file_bucket(tmp_path))
    out = tmp_path / "out"
    ref = start("--out", str(tmp_path / "ref"), "--result", str(tmp_path / "ref.pt"), "--best")
    killed = start("--out", str(out), "--result", str(tmp_path / "never.pt"), "--job", JOB,
                   "--socket", str(d.socket), "--resume", "ckptd", "--kill-after", "6",
                   "--best")  # fmt: skip
    wait_for(lambda: (tmp_path / "never.pt.ready.0").exists(), killed)
    killed[0].kill()
    finish(killed, rc=-9)
    (want,) = finish(ref)
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-6"]  # as the Trainer left it
    assert want["best"] == str(tmp_path / "ref" / "checkpoint-2")  # the highest eval_loss
    assert want["on_disk"] == ["checkpoint-2", "checkpoint-8"]
    assert adopted_steps(d) == [2, 4, 6]
    # save_total_limit and the best are the job's retention in ckptd's tiers too.
    rows = {c.step: c for c in d.client(JOB).list()}
    assert rows[2].remote_reasons == ("best-eval_loss",)
    assert rows[4].remote_reasons == ("latest",)

    d.kill()
    shutil.rmtree(d.root)
    shutil.rmtree(out)
    fresh: Daemon = remote_daemon(make_daemon, file_bucket(tmp_path))
    (got,) = run("--out", str(out), "--result", str(tmp_path / "resumed.pt"), "--job", JOB,
                 "--socket", str(fresh.socket), "--resume", "ckptd", "--best")  # fmt: skip
    assert got["resumed_from"] == str(out / "checkpoint-6")
    assert got["best"] == str(out / "checkpoint-2")
    assert got["on_disk"] == ["checkpoint-2", "checkpoint-8"]  # as the Trainer rotates
    # save_total_limit=2 kept the best (2) beside 6 (4 was rotated out): both come back.
    assert sorted(e.step for e in fresh.events_of(pb.STEP_EVENT_FETCHED, JOB)) == [2, 6]
    assert_identical(tmp_path / "resumed.pt", tmp_path / "ref.pt")  # the best model at the end


def test_the_trainers_rotation_as_a_policy(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    from ckptd.client.hf import retention_of

    def args(**kw: Any) -> Any:
        return TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kw)

    assert retention_of(args()) is None  # no limit: the Trainer keeps all, the node decides
    assert retention_of(args(save_total_limit=3)) == "KeepLatest(3)"
    best = args(save_total_limit=1, load_best_model_at_end=True, eval_strategy="steps",
                metric_for_best_model="loss")  # fmt: skip
    assert retention_of(best) == "KeepAny([KeepLatest(1), KeepBest('eval_loss', 1, 'min')])"


def test_named_steps_reads_the_trainer_state(tmp_path: Path) -> None:
    from ckptd.client.hf import named_steps

    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"best_model_checkpoint": "/elsewhere/out/checkpoint-3"}))
    assert named_steps(state, 9, [1, 3, 5, 7, 9], 3) == [3, 7]  # 9, the best, the newest
    assert named_steps(state, 9, [1, 3, 5, 7, 9], 4) == [3, 5, 7]
    assert named_steps(state, 3, [1, 3], 2) == [1]  # the resumed step is the best
    assert named_steps(state, 9, [1, 3, 5, 7, 9], None) == [3]  # no limit: the best only
    state.write_text(json.dumps({"best_model_checkpoint": None}))
    assert named_steps(state, 9, [1, 3, 5, 7, 9], 1) == []
    state.write_text("{not json")
    assert named_steps(state, 9, [7, 9], 2) == [7]  # unreadable: warned, the limit still kept
    assert named_steps(tmp_path / "missing.json", 9, [], 2) == []


def test_resume_on_a_fresh_start_and_what_it_refuses(daemon: Daemon, tmp_path: Path) -> None:
    """The script as documented runs the first time too: nothing to resume is None."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from ckptd.client import CheckpointNotFound, CkptdError
    from ckptd.client import hf as ckptd_hf

    out = tmp_path / "out"
    args = TrainingArguments(output_dir=str(out), report_to="none", use_cpu=True)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    callback = ckptd_hf.CkptdCallback(JOB, socket=daemon.socket)
    trainer = Trainer(model=model, args=args, callbacks=[callback])
    assert ckptd_hf.resume(trainer) is None  # no output_dir yet, nothing adopted
    (out / "checkpoint-3").mkdir(parents=True)  # written before ckptd was added
    assert ckptd_hf.resume(trainer) == str(out / "checkpoint-3")  # the Trainer's own
    with pytest.raises(CheckpointNotFound, match="no save of step 3"):
        ckptd_hf.resume(trainer, step=3)  # asked for, and ckptd has no such step
    plain = Trainer(model=model, args=args)
    with pytest.raises(CkptdError, match="has no CkptdCallback"):
        ckptd_hf.resume(plain)
    with pytest.raises(TypeError, match="job's name"):
        ckptd_hf.CkptdCallback()
    callback.close()
