"""torchtitan's own Trainer (``torchrun``, gloo, CPU) saving and resuming through ckptd
with the one flag a user adds: ``--override.imports
ckptd.client.torchtitan.ckptd_checkpoint --checkpoint.folder ckptd://<job>``.

Each test SIGKILLs the trainer right after a save returns, resumes it, and compares
its final model and optimizer state bit for bit with an uninterrupted run of stock
torchtitan (its DCP FileSystemWriter) on the same config: 1 process, 2 processes
(tensor parallel: each rank saves and loads its own shards), the sync and both async
modes, and a node that lost its disk (a fresh daemon on the same bucket).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan", reason="the torchtitan tests need ckptd[torchtitan]")
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="torchtitan's models import triton, which CPU builds of torch do not install",
)

from ckptd.proto import ckptd_pb2 as pb  # noqa: E402

from ..conftest import Daemon, RemoteTarget  # noqa: E402
from ..test_remote_tier import remote_daemon  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEPS, INTERVAL, KILL_AT = 6, 2, 4
WORDS = [
    *("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "one"),
    *("small", "model", "learns", "to", "predict", "tokens", "of", "a", "tiny", "corpus"),
    *("written", "for", "checkpoint", "tests", "on", "a", "cpu"),
]
TWO_RANKS = [
    "--parallelism.tensor-parallel-degree",
    "2",
    "--parallelism.data-parallel-shard-degree",
    "1",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer (tokenizer.json, as torchtitan's HF tokenizer loads it)
    and a JSON-lines corpus for the ``c4_test`` loader."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("titan-assets")
    specials = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]
    vocab = {w: i for i, w in enumerate(specials + sorted(set(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    config = {"bos_token": specials[1], "eos_token": specials[2], "add_bos_token": True}
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "data").mkdir()
    rng = random.Random(0)
    lines = [json.dumps({"text": " ".join(rng.choices(WORDS, k=40))}) for _ in range(200)]
    (root / "data" / "c4.json").write_text("\n".join(lines) + "\n")
    return root


def train(
    assets: Path,
    out: Path,
    nproc: int,
    flags: list[str],
    env: dict[str, str] | None = None,
    expect_kill: bool = False,
) -> None:
    """One torchrun of the Trainer; fails with its output unless it ended as expected
    (``expect_kill``: every rank SIGKILLed itself after its save of step ``KILL_AT``)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        str(REPO / "tests" / "frameworks" / "torchtitan_train.py"),
        "--module",
        "tests.frameworks.torchtitan_config",
        "--config",
        "tiny_llama3",
        "--hf-assets-path",
        str(assets / "tok"),
        "--dataloader.dataset-path",
        str(assets / "data"),
        "--dump-folder",
        str(out / "dump"),
        f"--training.steps={STEPS}",
        "--training.seq-len=32",
        "--training.local-batch-size=2",
        "--validator.no-enable",
        "--debug.seed=42",
        "--debug.deterministic",
        "--parallelism.spmd-backend=partial_dtensor",
        "--checkpoint.enable",
        f"--checkpoint.interval={INTERVAL}",
        *(TWO_RANKS if nproc == 2 else []),
        *flags,
    ]
    run_env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run_env.update(CKPTD_TT_OUT=str(out), **(env or {}))
    if expect_kill:
        run_env["CKPTD_TT_KILL_AFTER_SAVE"] = str(KILL_AT)
    p = subprocess.run(
        cmd, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=600, check=False
    )
    saved = sorted(out.glob("saved-*"))
    ok = (p.returncode != 0 and len(saved) == nproc) if expect_kill else p.returncode == 0
    assert ok, f"torchrun exited {p.returncode}:\n{(p.stdout + p.stderr)[-6000:]}"
    if expect_kill:
        assert {f.read_text() for f in saved} == {str(KILL_AT)}


def ckptd_flags(job: str, async_mode: str, **settings: str) -> list[str]:
    """What a torchtitan user adds to save through ckptd."""
    target = "ckptd.client.torchtitan.ckptd_checkpoint"
    if settings:
        target += "=" + json.dumps(settings)
    return [
        "--override.imports",
        target,
        "--checkpoint.folder",
        f"ckptd://{job}",
        f"--checkpoint.async-mode={async_mode}",
    ]


_references: dict[int, Path] = {}


@pytest.fixture(scope="module")
def reference(assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The final state of an uninterrupted stock-torchtitan run (per process count)."""

    def of(nproc: int) -> Path:
        if nproc not in _references:
            out = tmp_path_factory.mktemp(f"reference-{nproc}")
            train(assets, out, nproc, ["--checkpoint.folder", str(out / "checkpoint")])
            _references[nproc] = out
        return _references[nproc]

    return of


def resumed_steps(out: Path, nproc: int) -> set[int]:
    return {int((out / f"resumed-{r}").read_text()) for r in range(nproc)}


def assert_same_final(want: Path, got: Path, nproc: int) -> None:
    """Every rank's final model and optimizer state, bit for bit."""
    for rank in range(nproc):
        a = torch.load(want / f"final-{rank}.pt", weights_only=False)
        b = torch.load(got / f"final-{rank}.pt", weights_only=False)
        assert a["step"] == b["step"] == STEPS
        flat_a, flat_b = dict(flatten(a)), dict(flatten(b))
        assert flat_a.keys() == flat_b.keys()
        assert sum(isinstance(v, torch.Tensor) for v in flat_a.values()) > 10
        for k, v in flat_a.items():
            if isinstance(v, torch.Tensor):
                assert v.dtype == flat_b[k].dtype and v.shape == flat_b[k].shape, k
                assert torch.equal(
                    v.view(-1).view(torch.uint8), flat_b[k].view(-1).view(torch.uint8)
                ), k
            else:
                assert v == flat_b[k], k


def flatten(x: Any, prefix: str = "") -> Any:
    if isinstance(x, dict):
        for k, v in x.items():
            yield from flatten(v, f"{prefix}/{k}")
    else:
        yield prefix, x


@needs_triton
def test_one_process_sync_save_killed_then_resumed_is_bit_exact(
    daemon: Daemon, assets: Path, tmp_path: Path, reference: Any
) -> None:
    env = {"CKPTD_SOCKET": str(daemon.socket)}
    flags = ckptd_flags("titan-1", "disabled")
    train(assets, tmp_path / "killed", 1, flags, env, expect_kill=True)
    # A synchronous save returned: its step was LOCAL (restorable) before the kill.
    listed = {(c.step, c.state) for c in daemon.client("titan-1").list()}
    assert listed == {(2, "LOCAL"), (KILL_AT, "LOCAL")}
    train(assets, tmp_path / "resumed", 1, flags, env)
    assert resumed_steps(tmp_path / "resumed", 1) == {KILL_AT}
    assert_same_final(reference(1), tmp_path / "resumed", 1)
    assert {c.step for c in daemon.client("titan-1").list()} >= {KILL_AT, STEPS}


@needs_triton
def test_two_processes_async_save_killed_then_resumed_is_bit_exact(
    daemon: Daemon, assets: Path, tmp_path: Path, reference: Any
) -> None:
    env = {"CKPTD_SOCKET": str(daemon.socket)}
    flags = ckptd_flags("titan-2", "async")
    train(assets, tmp_path / "killed", 2, flags, env, expect_kill=True)
    # The save of KILL_AT waited for the one before it; its own may not have landed.
    client = daemon.client("titan-2")
    restorable = {c.step for c in client.list() if c.state in ("LOCAL", "DURABLE")}
    assert 2 in restorable
    train(assets, tmp_path / "resumed", 2, flags, env)
    assert resumed_steps(tmp_path / "resumed", 2) == {max(restorable)}
    assert_same_final(reference(2), tmp_path / "resumed", 2)


@needs_triton
def test_pinned_async_after_a_lost_disk_resumes_from_the_bucket(
    make_daemon: Any, assets: Path, tmp_path: Path, reference: Any
) -> None:
    bucket = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    d = remote_daemon(make_daemon, bucket)
    env = {"CKPTD_SOCKET": str(d.socket)}
    # wait="durable": a save completes once in the bucket, so step 2 is there before
    # the save of KILL_AT returns.
    flags = ckptd_flags("titan-node", "async_with_pinned_mem", wait="durable")
    train(assets, tmp_path / "killed", 1, flags, env, expect_kill=True)
    assert d.events_of(pb.STEP_EVENT_DURABLE, "titan-node", 2)
    assert d.stop() == 0
    shutil.rmtree(d.root)  # the node's disk is gone
    d.restart()
    train(assets, tmp_path / "resumed", 1, flags, env)
    (step,) = resumed_steps(tmp_path / "resumed", 1)
    assert step in (2, KILL_AT)
    assert [e.step for e in d.events_of(pb.STEP_EVENT_FETCHED, "titan-node")] == [step]
    assert_same_final(reference(1), tmp_path / "resumed", 1)


def test_checkpoint_manager_saves_and_finds_its_steps_in_ckptd(
    daemon: Daemon, tmp_path: Path
) -> None:
    # torchtitan's checkpoint manager without its Trainer (no triton): in each async
    # mode, save steps 1-3, resume fresh state from the latest, then from load_step=2,
    # then ask for a step that is not there.
    out = tmp_path / "seen.json"
    modes = ["disabled", "async", "async_with_pinned_mem"]
    p = subprocess.run(
        [sys.executable, "-m", "tests.frameworks.torchtitan_manager", str(out), *modes],
        cwd=REPO,
        env={**os.environ, "CKPTD_SOCKET": str(daemon.socket)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    for mode, seen in json.loads(out.read_text()).items():
        assert seen["fresh_start_loaded"] is False, mode
        assert [seen[f"saved_{s}"] for s in (1, 2, 3)] == [True, True, True], mode
        assert seen["loaded_-1"] and seen["equal_-1"] and seen["counters_-1"] == [3, 3], mode
        assert seen["loaded_2"] and seen["equal_2"] and seen["counters_2"] == [2, 2], mode
        assert "no step 9" in seen["missing"] and "[3, 2, 1]" in seen["missing"], mode
        assert [c.step for c in daemon.client(f"titan-{mode}").list()] == [3, 2, 1], mode

    # keep_latest_k=2 is the job's retention: the daemon keeps the newest two (and the
    # first step while they read its unchanged shards: incremental saves).
    def kept() -> list[int]:
        return [
            c.step
            for c in daemon.client("titan-keep").list()
            if not all(r.startswith("referenced-by-") for r in c.local_reasons)
        ]

    deadline = time.monotonic() + 60
    while kept() != [4, 3]:
        assert time.monotonic() < deadline, daemon.client("titan-keep").list()
        time.sleep(0.05)
    assert not daemon.events_of(pb.STEP_EVENT_EVICTED_LOCAL, "titan-keep", 1)
