"""Incremental saves, the client's part: the trainer's word on what did not change
(tokens: a torch tensor's storage and version, the very same jax array, each where
the client is told to trust them or jax alone writes the memory), and
no copy of shards the segment the daemon grants already holds (its ``holds_image``).
Every step restores bit-exact whatever was skipped."""

from __future__ import annotations

import gc
import json
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="these tests need torch (make venv installs it)")

from ckptd.client import Client  # noqa: E402
from ckptd.proto import ckptd_pb2 as pb  # noqa: E402

from .conftest import Daemon  # noqa: E402


class Spy:
    """What a client sends on CommitShards and what AcquireLease answers, as sent."""

    def __init__(self, client: Client, reuse: bool = True) -> None:
        self.commits: list[pb.CommitShardsRequest] = []
        self.leases: list[pb.Lease] = []
        conn = client.connection
        commit, acquire = conn.commit_shards, conn.acquire_lease

        def commit_shards(req: pb.CommitShardsRequest, *a: Any, **kw: Any) -> Any:
            self.commits.append(pb.CommitShardsRequest.FromString(req.SerializeToString()))
            return commit(req, *a, **kw)

        def acquire_lease(req: pb.AcquireLeaseRequest, *a: Any, **kw: Any) -> pb.Lease:
            assert req.reuse_image == reuse and req.rank == client.rank
            lease = acquire(req, *a, **kw)
            self.leases.append(lease)
            return lease

        conn.commit_shards = commit_shards  # type: ignore[method-assign]
        conn.acquire_lease = acquire_lease  # type: ignore[method-assign]

    def unchanged(self) -> dict[str, bool]:
        """The last commit's word, per shard key (raises if it sent none)."""
        req = self.commits[-1]
        assert req.incremental and req.unchanged, "no word on unchanged shards was sent"
        bits = np.unpackbits(np.frombuffer(req.unchanged, np.uint8), bitorder="little")
        return dict(zip(req.table.keys, bits.astype(bool).tolist(), strict=False))


KEEP_ALL = ["--retention-local", "KeepLatest(20)"]
"""Every step of a test stays restorable locally."""


@pytest.fixture
def keep_all(make_daemon: Any) -> Daemon:
    """A daemon without the memory tier (a committed save's segment goes back to the
    pool at once) that keeps every step."""
    d: Daemon = make_daemon(extra_args=["--memory-tier-steps", "0", *KEEP_ALL])
    return d


def restore_all(client: Client, snapshots: dict[int, dict[str, Any]]) -> None:
    """Every step restores bit-exact (at the end: a restore into shared memory takes a
    free segment, the one that held an image)."""
    for step, want in snapshots.items():
        got, _ = client.restore(step=step)
        for k, v in want.items():
            assert np.array_equal(np.asarray(got[k]), np.asarray(v)), (step, k)


def test_tensors_changed_in_place_are_never_reported_unchanged(daemon: Daemon) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    frozen = torch.randn(64)
    w = torch.zeros(16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()  # the optimizer has its state before the first save
    client = daemon.client("inplace", trust_torch_versions=True)
    spy = Spy(client)

    def state() -> dict[str, Any]:
        return {"frozen": frozen, "w": w, "model": model.state_dict(), "opt": opt.state_dict()}

    client.save(1, state()).wait("local")
    assert not spy.commits[-1].unchanged  # nothing saved before: no word
    w.add_(1)
    client.save(2, state()).wait("local")
    word = spy.unchanged()
    moments = [k for k in word if k.startswith("opt.state.")]
    assert spy.commits[-1].unchanged_since == 1
    assert word["frozen"] and word["model.weight"] and word["model.bias"]
    assert moments and all(word[k] for k in moments)  # no step since: untouched
    assert not word["w"]
    w.copy_(torch.full((16,), 7.0))
    client.save(3, state()).wait("local")
    word = spy.unchanged()
    assert not word["w"] and word["frozen"]
    with torch.no_grad():
        w[3] = 5.0  # an indexed write under no_grad
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    client.save(4, state()).wait("local")
    word = spy.unchanged()
    assert word["frozen"]
    assert not word["w"]
    assert not word["model.weight"] and not word["model.bias"]
    assert not any(word[k] for k in moments)  # Adam's moments and its step count
    got, _ = client.restore(step=4)
    assert torch.equal(got["model"]["weight"], model.weight.detach())
    assert torch.equal(got["w"], w)


def test_a_new_tensor_where_the_old_one_was_is_never_unchanged(daemon: Daemon) -> None:
    client = daemon.client("replaced", trust_torch_versions=True)
    spy = Spy(client)
    memory = np.zeros(1024, np.float32)
    t = torch.from_numpy(memory)
    address, version = t.data_ptr(), t._version
    client.save(1, {"t": t}).wait("local")
    del t
    gc.collect()
    # Another tensor at the very same address, shape, dtype and version, over a new
    # storage, whose values changed where torch could not see it.
    t = torch.from_numpy(memory)
    memory[:] = 5.0
    assert (t.data_ptr(), t._version) == (address, version)
    client.save(2, {"t": t}).wait("local")
    assert spy.unchanged() == {"t": False}
    got, _ = client.restore(step=2)
    assert torch.equal(got["t"], t)


def test_a_tensor_left_alone_is_unchanged_through_views_and_detach(daemon: Daemon) -> None:
    client = daemon.client("views", trust_torch_versions=True)
    spy = Spy(client)
    p = torch.nn.Parameter(torch.randn(8, 8))
    client.save(1, {"p": p, "t": p.detach().T}).wait("local")
    client.save(2, {"p": p, "t": p.detach().T}).wait("local")
    assert spy.unchanged() == {"p": True, "t": True}
    client.save(3, {"p": p, "t": p.detach()}).wait("local")  # another view: not the same
    assert spy.unchanged() == {"p": True, "t": False}
    p.detach()[0, 0] += 1  # through a detached alias: the version is shared
    client.save(4, {"p": p, "t": p.detach()}).wait("local")
    assert spy.unchanged() == {"p": False, "t": False}


def test_the_same_jax_array_is_unchanged_an_equal_new_one_is_not(daemon: Daemon) -> None:
    jnp = pytest.importorskip("jax.numpy")
    a, b = jnp.arange(32.0), jnp.ones(16)
    # By default a CPU array's identity is no proof (others may write its memory).
    default = daemon.client("jax-default")
    default_spy = Spy(default)
    default.save(1, {"a": a, "b": b}).wait("local")
    default.save(2, {"a": a, "b": b}).wait("local")
    assert default_spy.commits[-1].incremental and not default_spy.commits[-1].unchanged
    client = daemon.client("jax", trust_jax_arrays=True)
    spy = Spy(client)
    client.save(1, {"a": a, "b": b}).wait("local")
    client.save(2, {"a": a, "b": jnp.ones(16)}).wait("local")
    assert spy.unchanged() == {"a#0": True, "b#0": False}
    client.save(3, {"a": a + 0, "b": b}).wait("local")
    # b is the array saved at step 1, not at step 2: the word is about step 2.
    assert spy.unchanged() == {"a#0": False, "b#0": False}


def test_numpy_and_switched_off_clients_send_no_word(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = daemon.client("numpy")
    spy = Spy(client)
    x = np.arange(16.0)
    client.save(1, {"x": x}).wait("local")
    client.save(2, {"x": x}).wait("local")
    # numpy: nothing tells whether it changed; the daemon compares digests.
    assert spy.commits[-1].incremental and not spy.commits[-1].unchanged
    off = daemon.client("off", incremental=False)
    assert client.incremental and not off.incremental
    off_spy = Spy(off, reuse=False)
    t = torch.ones(4)
    off.save(1, {"t": t}).wait("local")
    off.save(2, {"t": t}).wait("local")
    assert not off_spy.commits[-1].incremental and not off_spy.commits[-1].unchanged
    assert spy.commits[-1].incremental
    monkeypatch.setenv("CKPTD_INCREMENTAL", "0")
    assert not daemon.client("env-off").incremental
    monkeypatch.setenv("CKPTD_INCREMENTAL", "maybe")
    with pytest.raises(ValueError, match="CKPTD_INCREMENTAL"):
        daemon.client("env-bad")


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() for k, v in state.items()}


def test_a_frozen_tensor_is_not_copied_again_and_every_step_restores(keep_all: Daemon) -> None:
    torch.manual_seed(1)
    frozen = torch.randn(256, 1024)  # 1 MiB
    adapter = torch.zeros(64, 64)
    client = keep_all.client("lora", trust_torch_versions=True)
    spy = Spy(client)
    snapshots = {}
    reused = []
    for step in range(1, 6):
        adapter.add_(step)
        state = {"frozen": frozen, "adapter": adapter}
        handle = client.save(step, state)
        handle.wait("local")
        reused.append(handle.reused_bytes)
        snapshots[step] = _snapshot(state)
    assert [lease.holds_image for lease in spy.leases] == [False] + [True] * 4
    assert [lease.holds_step for lease in spy.leases[1:]] == [1, 2, 3, 4]
    assert reused == [0] + [frozen.nbytes] * 4  # the adapter was copied every time
    restore_all(client, snapshots)


def test_the_memory_tier_gives_the_image_back_once_it_lets_it_go(make_daemon: Any) -> None:
    frozen = torch.randn(128, 1024)
    adapter = torch.zeros(32)
    client = make_daemon(extra_args=KEEP_ALL).client("tiered", trust_torch_versions=True)
    spy = Spy(client)
    snapshots = {}
    for step in range(1, 5):
        adapter.add_(1)
        client.save(step, {"frozen": frozen, "adapter": adapter}).wait("local")
        snapshots[step] = _snapshot({"frozen": frozen, "adapter": adapter})
    # The tier keeps the newest step's segment: step 2 gets another one, step 3 the
    # segment of step 1, which the tier let go when it kept step 2's.
    holds = [(lease.holds_image, lease.holds_step) for lease in spy.leases]
    assert holds[0] == (False, 0) and holds[2:] == [(True, 1), (True, 2)]
    restore_all(client, snapshots)


def test_a_segment_that_served_a_restore_read_holds_no_image(disk_daemon: Daemon) -> None:
    frozen = torch.randn(64, 1024)
    client = disk_daemon.client("restored", trust_torch_versions=True)
    spy = Spy(client)
    client.save(1, {"frozen": frozen}).wait("local")
    client.save(2, {"frozen": frozen}).wait("local")
    assert spy.leases[-1].holds_image  # the control: it does hold it
    # A restore read into shared memory takes the free segment (the one that holds
    # step 2's image) and writes into it; the client gives it back unmapped.
    answer = client.connection.restore(
        pb.RestoreRequest(job="restored", rank=0, step=1, shared_memory=True), 60.0
    )
    assert answer.HasField("lease") and answer.lease.segment == spy.leases[-1].segment
    client.connection.release_lease(pb.ReleaseLeaseRequest(lease_id=answer.lease.lease_id), 10.0)
    handle = client.save(3, {"frozen": frozen})
    handle.wait("local")
    assert spy.leases[-1].segment == answer.lease.segment
    assert not spy.leases[-1].holds_image and handle.reused_bytes == 0
    got, _ = client.restore(step=3)
    assert torch.equal(got["frozen"], frozen)


def test_another_client_of_the_same_job_and_rank_never_gets_the_image(
    disk_daemon: Daemon,
) -> None:
    t = torch.randn(64, 1024)
    first = disk_daemon.client("shared-name", trust_torch_versions=True)
    first.save(1, {"t": t}).wait("local")
    first.close()  # its liveness file goes: another process now
    second = disk_daemon.client("shared-name", trust_torch_versions=True)
    spy = Spy(second)
    handle = second.save(2, {"t": t})
    handle.wait("local")
    assert not spy.leases[-1].holds_image and handle.reused_bytes == 0
    handle = second.save(3, {"t": t})  # the control: its own image it gets
    handle.wait("local")
    assert spy.leases[-1].holds_image and handle.reused_bytes == t.nbytes


def test_a_frozen_jax_array_is_not_copied_again(keep_all: Daemon) -> None:
    jnp = pytest.importorskip("jax.numpy")
    frozen = jnp.arange(64 * 1024, dtype=jnp.float32)
    adapter = jnp.zeros(256)
    client = keep_all.client("jax-lora", trust_jax_arrays=True)
    spy = Spy(client)
    reused = []
    snapshots = {}
    for step in range(1, 4):
        adapter = adapter + step  # a new array every step: always copied
        handle = client.save(step, {"frozen": frozen, "adapter": adapter})
        handle.wait("local")
        reused.append(handle.reused_bytes)
        snapshots[step] = {"frozen": np.asarray(frozen), "adapter": np.asarray(adapter)}
    assert [lease.holds_image for lease in spy.leases] == [False, True, True]
    assert reused == [0, frozen.nbytes, frozen.nbytes]
    assert spy.unchanged() == {"frozen#0": True, "adapter#0": False}
    restore_all(client, snapshots)


def test_a_step_saved_twice_is_never_trusted_again(daemon: Daemon) -> None:
    frozen = torch.randn(64, 1024)
    x = torch.zeros(64, 1024)
    client = daemon.client("twice", trust_torch_versions=True)
    spy = Spy(client)
    client.save(1, {"frozen": frozen, "x": x}).wait("local")
    x.add_(1)
    client.save(2, {"frozen": frozen, "x": x}).wait("local")
    x.add_(1)
    client.save(2, {"frozen": frozen, "x": x}).wait("local")  # step 2 again
    handle = client.save(3, {"frozen": frozen, "x": x})
    handle.wait("local")
    # The memory tier kept step 2's first segment until the second was kept: step 3
    # gets the segment holding the FIRST image of step 2, whose x is not today's.
    assert (spy.leases[-1].holds_image, spy.leases[-1].holds_step) == (True, 2)
    assert handle.reused_bytes == 0 and not spy.commits[-1].unchanged
    got, _ = client.restore(step=3)
    assert torch.equal(got["x"], x) and torch.equal(got["frozen"], frozen)


def test_the_off_switch_in_a_shared_environment_does_not_stop_the_daemon(
    make_daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A node's environment often reaches the trainer and its sidecar alike.
    d = make_daemon(env={"CKPTD_INCREMENTAL": "0"})
    monkeypatch.setenv("CKPTD_INCREMENTAL", "0")
    client = d.client("env")
    assert not client.incremental
    spy = Spy(client, reuse=False)
    client.save(1, {"t": torch.ones(4)}).wait("local")
    assert not spy.commits[-1].incremental


def test_untrusted_torch_versions_send_no_word_and_batchnorm_statistics_are_saved(
    keep_all: Daemon,
) -> None:
    """BatchNorm updates its running statistics inside its kernel: ``_version`` stays.
    By default torch tensors carry no word and are copied; the daemon's digests find
    what changed, so every step restores bit-exact."""
    torch = pytest.importorskip("torch")
    client = keep_all.client("bn")
    spy = Spy(client)
    bn = torch.nn.BatchNorm1d(64)
    frozen = torch.randn(200_000)
    snapshots = {}
    for step in range(1, 4):
        before = bn.running_mean._version
        bn(torch.randn(32, 64))
        assert bn.running_mean._version == before  # torch does not count this write
        state = {"frozen": frozen, **{f"bn.{k}": v for k, v in bn.state_dict().items()}}
        client.save(step, state).wait("local", timeout=60)
        snapshots[step] = _snapshot(state)
    assert all(c.incremental and not c.unchanged for c in spy.commits)  # no word: digests
    manifest = json.loads((keep_all.root / "bn" / "3" / "manifest.json").read_text())
    assert manifest["ranks"][0]["refs"]  # the frozen tensor is referenced by digest
    restore_all(client, snapshots)
