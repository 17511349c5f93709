"""Incremental saves against a real daemon: a shard equal to the previous step's is
referenced, not written; every step restores bit-exact from what holds its bytes
(core/increments.py, daemon/local/increment.py, daemon/local/assemble.py).

These tests drive the numpy path, where the daemon compares SHA-256 digests: the
client's request builder is wrapped to ask for incremental saves.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest

from ckptd.client import CheckpointNotFound
from ckptd.client import saver as client_saver
from ckptd.core.manifest import MANIFEST, Manifest

from .conftest import Daemon
from .test_metrics import scrape
from .test_metrics import value as metric
from .test_remote_tier import remote_daemon, s3_target

RNG = np.random.default_rng(35)
MiB = 2**20
KEEP = ["--retention-local", "KeepLatest(100)"]


@pytest.fixture(autouse=True)
def incremental_requests(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every commit asks for an incremental save (the numpy path: no trainer's word)."""
    build = client_saver.Saver._commit_request

    def wrapped(self: Any, *args: Any, **kw: Any) -> Any:
        req = build(self, *args, **kw)
        req.incremental = True
        return req

    monkeypatch.setattr(client_saver.Saver, "_commit_request", wrapped)
    yield


def lora_state() -> dict[str, np.ndarray]:
    """Frozen weights (several MiB in many arrays) beside small changing adapters."""
    state = {f"base.{i}": RNG.standard_normal(64 * 1024).astype(np.float32) for i in range(24)}
    state.update({f"lora.{i}": RNG.standard_normal(3000).astype(np.float32) for i in range(4)})
    state["step"] = np.array([0], np.int64)
    return state


def manifest_of(d: Daemon, job: str, step: int) -> Manifest:
    return Manifest.from_json((d.root / job / str(step) / MANIFEST).read_text())


def save_steps(client: Any, state: dict[str, np.ndarray], steps: range) -> list[dict[str, Any]]:
    """Save ``steps``, changing the adapters (and the step counter) before each; the
    states as saved, copied."""
    saved = []
    for step in steps:
        for key in state:
            if key.startswith("lora.") or key == "step":
                state[key] = state[key] + 1
        client.save(step, state).wait("local", timeout=120)
        saved.append({k: v.copy() for k, v in state.items()})
    return saved


def assert_same(got: dict[str, Any], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert np.asarray(got[key]).tobytes() == value.tobytes(), key


def test_unchanged_shards_are_referenced_not_written(make_daemon: Any) -> None:
    d: Daemon = make_daemon(extra_args=[*KEEP, "--memory-tier-steps", "0"])
    client = d.client("lora")
    state = lora_state()
    saved = save_steps(client, state, range(1, 5))
    first = manifest_of(d, "lora", 1)
    assert first.increment == 0 and not first.ranks[0].incremental
    image = first.ranks[0].size
    for step in range(2, 5):
        m = manifest_of(d, "lora", step)
        rank = m.ranks[0]
        assert rank.incremental and m.increment == step - 1
        # The frozen weights stay in step 1's file; each step holds its adapters.
        assert m.holders() == {1}
        assert rank.image_size == image
        changed = sum(v.nbytes for k, v in state.items() if not k.startswith("base."))
        assert rank.size <= len(json.dumps(rank.tree)) + 64 * 1024 + 4 * changed
        assert (d.root / "lora" / str(step) / rank.file).stat().st_size == rank.size
    for step, want in zip(range(1, 5), saved, strict=True):
        got, _ = client.restore(step=step)
        assert_same(got, want)
    # The metric counts what the references spared: the frozen weights, three times.
    frozen = sum(v.nbytes for k, v in state.items() if k.startswith("base."))
    assert metric(scrape(d), "ckptd_bytes_total", stage="referenced") >= 3 * frozen - 3 * 8192


def crc_twin(data: bytes) -> bytes:
    """Different bytes of the same length and the same crc32c: crc32c is affine over
    GF(2), so flipping a set of bits whose crc effects cancel keeps the crc. Found by
    elimination over the effects of single-bit flips in the first 8 bytes."""
    base = google_crc32c.value(data)

    def effect(bit: int) -> int:
        b = bytearray(data)
        b[bit // 8] ^= 1 << (bit % 8)
        return google_crc32c.value(bytes(b)) ^ base

    rows = [(effect(bit), 1 << bit) for bit in range(64)]  # (crc effect, bits flipped)
    basis: dict[int, tuple[int, int]] = {}
    for value, flips in rows:
        while value:
            top = value.bit_length() - 1
            if top not in basis:
                basis[top] = (value, flips)
                break
            value, flips = value ^ basis[top][0], flips ^ basis[top][1]
        else:
            out = bytearray(data)
            for bit in range(64):
                if flips >> bit & 1:
                    out[bit // 8] ^= 1 << (bit % 8)
            assert bytes(out) != data and google_crc32c.value(bytes(out)) == base
            return bytes(out)
    raise AssertionError("64 flips always leave a combination that cancels")


def test_a_changed_shard_with_the_same_crc_is_still_written(make_daemon: Any) -> None:
    """Same place, same crc32c, different bytes: without the trainer's word the
    SHA-256 digest decides, and the shard is written."""
    d: Daemon = make_daemon(extra_args=[*KEEP, "--memory-tier-steps", "0"])
    client = d.client("twin")
    a = RNG.integers(0, 2**31, 50_000).astype(np.int32)
    twin = np.frombuffer(crc_twin(a.tobytes()), np.int32).copy()
    other = RNG.standard_normal(50_000).astype(np.float32)
    client.save(1, {"x": a, "y": other}).wait("local", timeout=60)
    client.save(2, {"x": twin, "y": other}).wait("local", timeout=60)
    m = manifest_of(d, "twin", 2)
    assert m.ranks[0].incremental  # y is referenced ...
    got, _ = client.restore(step=2)
    assert_same(got, {"x": twin, "y": other})  # ... x, its crc equal, is not


def test_restores_after_the_holder_is_gone_from_memory_and_disk_reads(
    make_daemon: Any,
) -> None:
    """With the memory tier on, the newest step restores from memory; an older
    incremental step from its files."""
    d: Daemon = make_daemon(extra_args=KEEP)
    client = d.client("mem")
    state = lora_state()
    saved = save_steps(client, state, range(1, 4))
    got, _ = client.restore()
    assert_same(got, saved[-1])
    got, _ = client.restore(step=2)
    assert_same(got, saved[1])


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_corrupt_referenced_range_is_never_served(make_daemon: Any) -> None:
    """Every step reads the damaged bytes of step 1's file: each is set aside, and the
    restore says there is nothing restorable rather than serve one."""
    d: Daemon = make_daemon(extra_args=[*KEEP, "--memory-tier-steps", "0"])
    client = d.client("rot")
    save_steps(client, lora_state(), range(1, 4))
    m = manifest_of(d, "rot", 3)
    ref = m.ranks[0].refs[0]  # type: ignore[index]
    flip(d.root / "rot" / str(ref[2]) / m.ranks[0].file, ref[3] + ref[1] // 2)
    with pytest.raises(CheckpointNotFound):
        client.restore()
    assert not [p for p in (d.root / "rot").iterdir() if p.name.isdigit()]


def test_a_corrupt_own_run_falls_back_to_the_previous_step(make_daemon: Any) -> None:
    d: Daemon = make_daemon(extra_args=[*KEEP, "--memory-tier-steps", "0"])
    client = d.client("own")
    saved = save_steps(client, lora_state(), range(1, 4))
    rank = manifest_of(d, "own", 3).ranks[0]
    assert rank.runs is not None
    flip(d.root / "own" / "3" / rank.file, rank.size - 10)
    got, _ = client.restore()
    assert_same(got, saved[1])
    assert not (d.root / "own" / "3").exists()


@pytest.mark.parametrize("point", ["write.increment", "write.begin"])
def test_killed_writing_an_incremental_step(make_daemon: Any, point: str) -> None:
    """SIGKILLed with the decision made (the base held) or the file begun: the
    journal replays the save, which references what the base holds again, and every
    step restores bit-exact."""
    d: Daemon = make_daemon(extra_args=[*KEEP, "--memory-tier-steps", "0"])
    client = d.client("kill")
    state = lora_state()
    saved = save_steps(client, state, range(1, 3))
    d.stop()
    d.env = {"CKPTD_FAILPOINTS": f"{point}=pause"}
    d.restart()
    for key in ("lora.0", "step"):
        state[key] = state[key] + 1
    saved.append({k: v.copy() for k, v in state.items()})
    handle = client.save(3, state)  # acknowledged: journaled before the answer
    d.wait_failpoint(point)
    d.kill()
    d.env = {}
    d.restart()
    handle.wait("local", timeout=120)
    m = manifest_of(d, "kill", 3)
    # The frozen weights in step 1's file, the adapters step 3 did not change in 2's.
    assert m.ranks[0].incremental and m.holders() == {1, 2}
    for step, want in zip(range(1, 4), saved, strict=True):
        got, _ = client.restore(step=step)
        assert_same(got, want)


def test_a_chain_is_bounded_by_full_saves(make_daemon: Any) -> None:
    """Every third save of a chain is full; a save whose references would read more
    files than incremental_max_files allows is written in full too."""
    d: Daemon = make_daemon(extra_args=[*KEEP, "--incremental-full-every", "3"])
    client = d.client("chain")
    saved = save_steps(client, lora_state(), range(1, 6))
    assert [manifest_of(d, "chain", s).increment for s in range(1, 6)] == [0, 1, 2, 0, 1]
    assert manifest_of(d, "chain", 5).holders() == {4}

    d2: Daemon = make_daemon(extra_args=[*KEEP, "--incremental-max-files", "2"])
    c2 = d2.client("fan")
    state = lora_state()
    c2.save(1, state).wait("local", timeout=60)
    state["lora.0"] = state["lora.0"] + 1  # step 2 references step 1: two files
    c2.save(2, state).wait("local", timeout=60)
    state["lora.1"] = state["lora.1"] + 1  # step 3 would read steps 1 and 2 and its own
    c2.save(3, state).wait("local", timeout=60)
    assert manifest_of(d2, "fan", 2).holders() == {1}
    assert not manifest_of(d2, "fan", 3).ranks[0].incremental
    got, _ = c2.restore(step=3)
    assert_same(got, state)
    for step, want in zip(range(1, 6), saved, strict=True):
        got, _ = client.restore(step=step)
        assert_same(got, want)


def test_two_ranks_of_a_node_each_reference_their_own_files(make_daemon: Any) -> None:
    d: Daemon = make_daemon(extra_args=[*KEEP, "--memory-tier-steps", "0"])
    clients = [d.client("two", rank=r, node_ranks=[0, 1], world_size=2) for r in (0, 1)]
    states = [lora_state(), lora_state()]
    saved: list[list[dict[str, Any]]] = [[], []]
    for step in range(1, 4):
        handles = []
        for r, (c, state) in enumerate(zip(clients, states, strict=True)):
            state["lora.0"] = state["lora.0"] + r + 1
            handles.append(c.save(step, state))
            saved[r].append({k: v.copy() for k, v in state.items()})
        for h in handles:
            h.wait("local", timeout=60)
    m = manifest_of(d, "two", 3)
    assert [r.rank for r in m.ranks] == [0, 1]
    assert all(r.incremental and r.holders() == {1} for r in m.ranks)
    for step in range(1, 4):
        for r, c in enumerate(clients):
            got, _ = c.restore(step=step)
            assert_same(got, saved[r][step - 1])


def test_retention_keeps_the_referenced_step_and_evicts_the_rest(make_daemon: Any) -> None:
    """KeepLatest(2): the two newest stay, and step 1, which they reference, with
    them; the steps between go as soon as nothing kept references them."""
    d: Daemon = make_daemon(extra_args=["--retention-local", "KeepLatest(2)"])
    client = d.client("keep")
    saved = save_steps(client, lora_state(), range(1, 7))
    d.stub()  # the evictor runs on LOCAL events: wait until it settled
    deadline = time.monotonic() + 60
    while sorted(c.step for c in client.list() if "LOCAL" in c.tiers) != [1, 5, 6]:
        assert time.monotonic() < deadline, [(c.step, c.tiers) for c in client.list()]
        time.sleep(0.05)
    for step in (1, 5, 6):
        got, _ = client.restore(step=step)
        assert_same(got, saved[step - 1])


def test_a_node_lost_restores_the_newest_incremental_step_from_the_bucket(
    make_daemon: Any, s3_server: Any
) -> None:
    """Saved with references, drained, the disk lost: a new daemon on the bucket
    brings step 1 (referenced) with the newest and restores it bit-exact."""
    remote = s3_target(s3_server, "ckptd-incremental-node-lost")
    d = remote_daemon(make_daemon, remote, extra_args=["--retention-local", "KeepLatest(2)"])
    client = d.client("lost")
    saved = save_steps(client, lora_state(), range(1, 5))
    client.wait_until_finished("durable", timeout=120)
    uploaded = {c.step for c in client.list() if "REMOTE" in c.tiers}
    assert {1, 4} <= uploaded
    assert d.stop() == 0
    shutil.rmtree(d.root)
    fresh = remote_daemon(make_daemon, remote, root=d.root)
    got, _ = fresh.client("lost").restore()
    assert_same(got, saved[-1])  # step 4's state, assembled from steps 4 and 1
    local = sorted(c.step for c in fresh.client("lost").list() if "LOCAL" in c.tiers)
    assert local == [1, 4]


def test_saves_where_everything_changed_are_written_in_one_pass(make_daemon: Any) -> None:
    """After a save where every array changed, the next writes whole without reading
    the lease for a comparison first (its crc32c computed on the way). The first save
    after the arrays stop changing is written whole too (steps 4 and 7); the one after
    it references them again, and every step restores bit-exact."""
    d: Daemon = make_daemon(extra_args=[*KEEP, "--memory-tier-steps", "0"])
    client = d.client("steps")
    state = lora_state()
    saved = []
    for step, change in enumerate([True, True, True, False, False, True, False, False], start=1):
        if change:
            state = {k: v + 1 for k, v in state.items()}
        client.save(step, state).wait("local", timeout=120)
        saved.append({k: v.copy() for k, v in state.items()})
    written = [manifest_of(d, "steps", s).ranks[0].incremental for s in range(1, 9)]
    assert written == [False, False, False, False, True, False, False, True]
    assert manifest_of(d, "steps", 5).holders() == {4}
    assert manifest_of(d, "steps", 8).holders() == {7}
    for step, want in enumerate(saved, start=1):
        got, _ = client.restore(step=step)
        assert_same(got, want)
