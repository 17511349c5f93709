"""PyTorch Lightning through ckptd: Lightning's own Trainer.fit loop (tests/frameworks/
lightning_worker.py: a tiny module, CPU, gloo) against a real daemon.

- ModelCheckpoint(save_last, save_top_k, monitor, every_n_train_steps): every global
  step reaches the daemon once although Lightning saves it under two names; the
  steps Lightning keeps are pinned, the ones it removes unpinned; every name loads
  back the dict Lightning saved, value for value and type for type.
- fit(ckpt_path="last") resumes from ckptd's newest step (a run that silently
  started from scratch fails here), also "ckptd://<job>/latest" and "/<step>".
- The trainer SIGKILLed right after a save returned; restarted with "last", it ends
  bit-identical to a run never interrupted. The same after the node's disk is
  wiped (a fresh daemon on the same bucket), and with DDP on 2 processes.
"""

from __future__ import annotations

import argparse
import collections
import copy
import enum
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

from ckptd.client import SaveHandle  # noqa: E402
from ckptd.client.lightning import CkptdCheckpointIO  # noqa: E402
from ckptd.core.errors import CheckpointNotFound  # noqa: E402
from ckptd.proto import ckptd_pb2 as pb  # noqa: E402

from ..conftest import Daemon  # noqa: E402
from . import lightning_worker as worker  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
)

WORKER = Path(worker.__file__)
STEPS = 14
"""Steps of a whole run; saves every 3 steps (3, 6, 9, 12), 5 batches an epoch."""
KILL_AT = 9


def run(daemon: Daemon, job: str, max_steps: int, ckpt_path: str | None = None, **kw: Any) -> Any:
    """A run in this process; returns its final state (lightning_worker.state_of)."""
    io = kw.pop("io", None) or CkptdCheckpointIO(job, daemon.socket)
    model = worker.Tiny()
    t = worker.trainer(str(daemon.socket), job, max_steps, io=io, **kw)
    t.fit(model, ckpt_path=ckpt_path)
    io.store.close()
    return worker.state_of(t, model)


def assert_same(got: Any, want: Any, path: str = "") -> None:
    """Equal value for value, type for type; tensors bit for bit."""
    assert type(got) is type(want), f"{path}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(_bytes(got), _bytes(want)), path
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
        assert getattr(got, "__dict__", {}).keys() == getattr(want, "__dict__", {}).keys()
        if hasattr(want, "_metadata"):
            assert got._metadata == want._metadata, path
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), path
    elif isinstance(want, np.ndarray | np.generic):
        assert got.dtype == want.dtype and np.array_equal(got, want), path
    else:
        assert got == want, path


def _bytes(t: Any) -> Any:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_bit_identical(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Weights, buffers, optimizer and scheduler state of two finished runs."""
    assert got["global_step"] == want["global_step"]
    for key in ("model", "optim", "sched"):
        assert_same(got[key], want[key], key)


def test_importing_the_module_loads_neither_lightning_nor_torch() -> None:
    code = (
        "import sys, ckptd.client, ckptd.client.lightning; "
        "print(sorted(m for m in ('torch', 'lightning', 'pytorch_lightning') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- ModelCheckpoint's choices --------------------------------------------------------
class Recording(CkptdCheckpointIO):
    """The real IO, keeping a deep copy of each dict Lightning hands it (by step)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.handed: dict[int, dict[str, Any]] = {}

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        self.handed.setdefault(checkpoint["global_step"], copy.deepcopy(checkpoint))
        super().save_checkpoint(checkpoint, path, storage_options)


def test_model_checkpoint_saves_each_step_once_and_pins_what_lightning_keeps(
    daemon: Daemon,
) -> None:
    io = Recording("mc", daemon.socket)
    model = worker.Tiny()
    t = worker.trainer(str(daemon.socket), "mc", STEPS, io=io)
    t.fit(model)
    cb = t.checkpoint_callback
    assert cb is not None
    # save_last saves each step a second time as last.ckpt: the daemon got each once.
    staged = [e.step for e in daemon.events_of(pb.STEP_EVENT_STAGED, "mc")]
    assert sorted(staged) == [3, 6, 9, 12] == sorted(io.handed)
    assert not daemon.events_of(pb.STEP_EVENT_REPLACED, "mc")
    # Lightning's names are the steps it saved; what it keeps is pinned, the rest not.
    assert cb.last_model_path == "ckptd://mc/last.ckpt" and len(cb.best_k_models) == 2
    assert io.store.names == {n: step_of(n) for n in cb.best_k_models} | {cb.last_model_path: 12}
    pinned = {c.step for c in io.client.list() if c.pinned}
    assert pinned == set(io.store.names.values()) and 12 in pinned
    # Every name loads back the dict Lightning saved, exactly (an OrderedDict state dict
    # with its _metadata, tuples, None, callbacks' tensors, loops' progress).
    for name, step in io.store.names.items():
        assert_same(io.load_checkpoint(name, weights_only=True), io.handed[step], name)
    kept = min(step_of(n) for n in cb.best_k_models)  # by its step, not a name
    assert_same(io.load_checkpoint(f"ckptd://mc/{kept}"), io.handed[kept])
    # save_top_k is the job's retention in every tier: the best 2 by the monitored
    # value, sent with each save; ranked as Lightning ranks them.
    assert "KeepBest('train_loss', 2, 'min')" in (daemon.root / "job-retention.json").read_text()
    scores = {c.step: c.metrics["train_loss"] for c in io.client.list()}
    assert {step_of(n): float(v) for n, v in cb.best_k_models.items()}.items() <= scores.items()
    assert set(sorted(scores, key=lambda s: (scores[s], -s))[:2]) == {
        step_of(n) for n in cb.best_k_models
    }
    with pytest.raises(CheckpointNotFound, match="ckptd://mc/latest"):
        io.load_checkpoint("/elsewhere/epoch=0-step=3.ckpt")
    # remove_checkpoint (Lightning dropping a top-k file) unpins; retention decides.
    other = next(n for n in cb.best_k_models if step_of(n) != 12)
    io.remove_checkpoint(other)
    assert other not in io.store.names
    rows = {c.step: c for c in io.client.list()}
    assert not rows[step_of(other)].pinned and rows[12].pinned
    io.store.close()


def step_of(name: str) -> int:
    """The step in a name made from ModelCheckpoint's default template."""
    return int(name.split("step=")[1].removesuffix(".ckpt"))


def test_a_resumed_run_keeps_the_names_lightning_still_refers_to() -> None:
    from ckptd.client.lightning.pins import names_after_restore

    saved = {"ckptd://j/s3": 3, "ckptd://j/s6": 6, "ckptd://j/s9": 9, "ckptd://j/last": 6}
    saved["/tmp/manual.ckpt"] = 2  # trainer.save_checkpoint's own name: never dropped
    state = {
        "dirpath": "ckptd://j",
        "best_k_models": {"ckptd://j/s6": torch.tensor(0.5), "ckptd://j/s9": torch.tensor(0.4)},
        "best_model_path": "ckptd://j/s9",
        "kth_best_model_path": "ckptd://j/s6",
        "last_model_path": "ckptd://j/last",
    }
    checkpoint = {"callbacks": {"ModelCheckpoint{...}": state, "Other": {"x": 1}}}
    # s3 left the top-k before step 9 was saved (its removal died with the run); the
    # last checkpoint is the step resumed from (its save came after this one's).
    assert names_after_restore(saved, checkpoint, 9) == {
        "ckptd://j/s6": 6,
        "ckptd://j/s9": 9,
        "ckptd://j/last": 9,
        "/tmp/manual.ckpt": 2,
    }


class Color(enum.Enum):
    """A value only a pickle holds."""

    RED = 1


Pair = collections.namedtuple("Pair", "a b")


def test_values_a_tree_cannot_hold_come_back_as_they_were(daemon: Daemon) -> None:
    state = collections.OrderedDict(w=torch.arange(6.0).reshape(2, 3))
    state._metadata = collections.OrderedDict({"": {"version": 2}})  # type: ignore[attr-defined]
    checkpoint = {
        "global_step": 4,
        "state_dict": state,
        "floats": [math.inf, -math.inf, math.nan, -0.0, 1e-310],
        "ints": (2**70, -(2**63), True, None),
        "keys": {0: "int key", "s": {1: torch.tensor([1, 2], dtype=torch.int8)}},
        "np": [np.float32(1.5), np.arange(3, dtype=np.uint16)],
        "odd": {("a", 1): torch.ones(2)},  # keys a tree cannot hold: pickled whole
        "objects": [Color.RED, {1, 2}, b"\x00bytes", Pair(torch.zeros(1), "x")],
        "hparams": argparse.Namespace(lr=0.1),
        "empty": [{}, [], ()],
    }
    io = CkptdCheckpointIO("codec", daemon.socket)
    io.save_checkpoint(checkpoint, "/x/a.ckpt")
    assert_same(io.load_checkpoint("/x/a.ckpt", weights_only=False), checkpoint)
    # weights_only=True reads the pickled values as torch.load would: it refuses an enum.
    with pytest.raises(Exception, match=r"[Ww]eights only load failed"):
        io.load_checkpoint("ckptd://codec/4", weights_only=True)
    # The tensors are tree leaves (named shards), not pickled.
    tree, _ = io.client.restore(step=4)
    assert torch.equal(tree["checkpoint"]["state_dict"]["w"], state["w"])
    io.store.close()


# -- resuming ---------------------------------------------------------------------------
def test_ckpt_path_last_resumes_from_ckptd_never_from_scratch(daemon: Daemon) -> None:
    want = run(daemon, "whole", STEPS)
    # save_top_k=-1: Lightning keeps every step (so does the job's retention), and
    # the explicit step below is still there.
    first = run(daemon, "halves", KILL_AT, top_k=-1)
    assert first["start_step"] == 0
    # A new Trainer, a new CheckpointIO: Lightning would look for last*.ckpt files here.
    resumed = run(daemon, "halves", STEPS, ckpt_path="last", top_k=-1)
    assert resumed["start_step"] == KILL_AT, "fit(ckpt_path='last') did not resume"
    assert_bit_identical(resumed, want)
    # An explicit step, and "latest", through the same path.
    again = run(daemon, "halves", STEPS, ckpt_path="ckptd://halves/6", top_k=-1)
    assert again["start_step"] == 6
    assert_bit_identical(again, want)
    latest = run(daemon, "halves", STEPS + 1, ckpt_path="ckptd://halves/latest", top_k=-1)
    assert latest["start_step"] == 12


def test_best_model_path_loads_as_a_file_would_in_this_process_and_a_fresh_one(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Model.load_from_checkpoint(best_model_path)``, ``torch.load`` of it through
    fsspec and ``load_checkpoint``: the dict Lightning saved, here and in a process
    that never trained (the name is read from the job's newest step)."""
    import fsspec

    from ckptd.client.lightning import load_checkpoint
    from ckptd.client.lightning.store import STORES

    monkeypatch.setenv("CKPTD_SOCKET", str(daemon.socket))  # what a fresh process is given
    io = Recording("serve", daemon.socket)
    t = worker.trainer(str(daemon.socket), "serve", STEPS, io=io)
    t.fit(worker.Tiny())
    best = t.checkpoint_callback.best_model_path  # type: ignore[union-attr]
    step = step_of(best)
    assert best.startswith("ckptd://serve/") and step in (3, 6, 9, 12)
    want = io.handed[step]
    io.store.close()
    for fresh in (False, True):
        if fresh:
            STORES.pop("serve", None)  # as in a process that only evaluates
        model = worker.Tiny.load_from_checkpoint(best)
        assert_same(model.state_dict(), want["state_dict"], "load_from_checkpoint")
        assert model.hparams == want["hyper_parameters"]
        with fsspec.open(best).open() as f:
            assert_same(torch.load(f, weights_only=True), want, "torch.load")
        assert_same(load_checkpoint(best), want, "load_checkpoint")
    with pytest.raises(CheckpointNotFound, match="not a checkpoint name"):
        load_checkpoint("ckptd://serve/epoch=9-step=99.ckpt")
    with pytest.raises(NotImplementedError, match="CkptdCheckpointIO"):
        fsspec.open("ckptd://serve/new.ckpt", "wb").open()


def test_the_plugin_with_a_plain_model_checkpoint_refuses_to_train_over_the_job(
    daemon: Daemon,
) -> None:
    """A half-done migration: ckptd's CheckpointIO, Lightning's own ModelCheckpoint and
    fit(ckpt_path="last"). Lightning finds no last*.ckpt and would train from scratch
    over the job's steps; the callback ckptd registers with Lightning refuses first."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckptd.core.errors import FailedPrecondition

    def plain(max_steps: int) -> Any:
        return L.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            plugins=[CkptdCheckpointIO("migrating", daemon.socket)],
            callbacks=[ModelCheckpoint(dirpath="ckptd://migrating", every_n_train_steps=3)],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    first = plain(6)
    assert any(type(cb).__name__ == "CkptdResumeGuard" for cb in first.callbacks)
    first.fit(worker.Tiny())  # the job has no step yet: trains and saves
    first.strategy.checkpoint_io.store.close()
    assert daemon.client("migrating").latest_step() == 6
    second = plain(12)
    model = worker.Tiny()
    with pytest.raises(FailedPrecondition, match="CkptdModelCheckpoint"):
        second.fit(model, ckpt_path="last")
    assert second.global_step == 0 and daemon.client("migrating").latest_step() == 6
    # Resuming by ckptd's own path trains on, the plain ModelCheckpoint beside it.
    third = plain(9)
    third.fit(worker.Tiny(), ckpt_path="ckptd://migrating/latest")
    assert third.global_step == 9
    third.strategy.checkpoint_io.store.close()


def test_a_fresh_run_under_a_used_job_name_saves_every_step_again(daemon: Daemon) -> None:
    first = run(daemon, "rerun", STEPS)
    pinned_before = {c.step for c in daemon.client("rerun").list() if c.pinned}
    again = run(daemon, "rerun", STEPS)  # no ckpt_path: a new run, same name
    assert again["start_step"] == 0
    assert_bit_identical(again, first)
    staged = sorted(e.step for e in daemon.events_of(pb.STEP_EVENT_STAGED, "rerun"))
    assert staged == [3, 3, 6, 6, 9, 9, 12, 12]  # none refused for the first run's pins
    assert {c.step for c in daemon.client("rerun").list() if c.pinned} == pinned_before


def worker_cmd(daemon: Daemon, job: str, out: Path, *args: str) -> list[str]:
    return [sys.executable, str(WORKER), "--socket", str(daemon.socket), "--job", job,
            "--out", str(out), "--max-steps", str(STEPS), *args]  # fmt: skip


def finish(proc: subprocess.Popen[str], what: str, timeout: float = 240.0) -> None:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    assert proc.returncode == 0, f"{what} failed:\n{err[-5000:]}"


def test_sigkill_right_after_a_save_resumes_bit_identical(daemon: Daemon, tmp_path: Path) -> None:
    marker = tmp_path / "saved"
    killed = subprocess.Popen(
        worker_cmd(
            daemon,
            "killed",
            tmp_path / "never.pt",
            "--kill-at",
            str(KILL_AT),
            "--marker",
            str(marker),
        ),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not marker.exists():  # written once save_checkpoint returned, then it waits
        assert killed.poll() is None, killed.communicate()[1][-5000:]
        assert time.monotonic() < deadline, "the trainer never reached its save"
        time.sleep(0.05)
    os.kill(killed.pid, signal.SIGKILL)
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    # Restarted at once: the acknowledged step may still be being written; "last" is it.
    resumed = subprocess.Popen(
        worker_cmd(daemon, "killed", tmp_path / "out.pt", "--ckpt-path", "last"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    finish(resumed, "the resumed trainer")
    got = torch.load(tmp_path / "out.rank0.pt", weights_only=False)
    assert got["start_step"] == KILL_AT
    assert_bit_identical(got, run(daemon, "reference", STEPS))


def test_node_loss_resumes_from_the_bucket(make_daemon: Any, tmp_path: Path) -> None:
    bucket = f"file://{tmp_path / 'bucket'}"
    d = make_daemon(extra_args=["--remote", bucket])
    want = run(d, "reference", STEPS)
    run(d, "lost", KILL_AT)
    client = d.client("lost")
    SaveHandle(client, KILL_AT).wait("durable", 120)
    assert d.stop() == 0
    import shutil

    shutil.rmtree(d.root)  # the node's disk is gone; a fresh daemon on the same bucket
    d.restart()
    resumed = run(d, "lost", STEPS, ckpt_path="last")
    assert resumed["start_step"] == KILL_AT, "resumed from scratch after the node was lost"
    assert_bit_identical(resumed, want)


def test_ddp_two_processes_resume_bit_identical(daemon: Daemon, tmp_path: Path) -> None:
    def launch(job: str, out: str, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            worker_cmd(daemon, job, tmp_path / out, "--devices", "2", *args),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    # Lightning hands the checkpoint to global rank 0 only: one ckptd rank per step.
    finish(launch("ddp", "ref.pt"), "the DDP run")
    client = daemon.client("ddp")
    assert [c.step for c in client.list()][:2] == [12, 9]
    # A new DDP run: both ranks resolve "last", agree on step 12 over torch.distributed,
    # load rank 0's part, and end exactly as the run that was never interrupted.
    finish(launch("ddp", "out.pt", "--ckpt-path", "last"), "the resumed DDP run")
    for rank in (0, 1):
        got = torch.load(tmp_path / f"out.rank{rank}.pt", weights_only=False)
        want = torch.load(tmp_path / f"ref.rank{rank}.pt", weights_only=False)
        assert got["rank"] == rank and got["start_step"] == 12
        assert_bit_identical(got, want)


def test_the_standalone_pytorch_lightning_package_resumes_too(daemon: Daemon) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from ckptd.client.lightning.pl import CkptdAsyncCheckpointIO, CkptdModelCheckpoint

    class Small(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            g = torch.Generator().manual_seed(self.trainer.global_step)
            return self.layer(torch.randn(8, 4, generator=g)).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(range(4), batch_size=1)

    def fit(max_steps: int, ckpt_path: str | None = None) -> tuple[Any, int]:
        io = CkptdAsyncCheckpointIO("pl", daemon.socket)
        t = pl.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            plugins=[io],
            callbacks=[CkptdModelCheckpoint(save_last=True, every_n_train_steps=2)],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        model = Small()
        starts: list[int] = []
        model.on_train_start = lambda: starts.append(t.global_step)  # type: ignore[method-assign]
        t.fit(model, ckpt_path=ckpt_path)
        io.store.close()
        return model.layer.weight.detach().clone(), starts[0]

    want, _ = fit(6)
    fit(4)
    got, start = fit(6, ckpt_path="last")
    assert start == 4 and torch.equal(got, want)
