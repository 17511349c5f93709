"""The accelerator path on a real GPU: CUDA tensors copied device-to-host straight
into the lease (page-locked, on a side stream, the trainer's later writes ordered
after the copies), restored onto CUDA targets through page-locked staging, DCP's
``async_save`` staging CUDA tensors into a lease, and jax GPU arrays saved and
restored sharded over the node's devices. Every test skips on a machine without
a GPU (CI's), saying so; ``make test-gpu`` runs them where there is one."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need torch")

if not torch.cuda.is_available():
    pytest.skip(
        "no CUDA device on this machine: the GPU path is tested where there is one",
        allow_module_level=True,
    )

MiB = 2**20


def cuda_state() -> dict[str, Any]:
    """Leaves of every kind the device path handles: large and small, dtypes numpy has
    and those it lacks, a lazily conjugated and a non-contiguous view, a CPU array."""
    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(64 * MiB // 4, device="cuda", generator=g)  # 64 MiB: copies take a while
    c = torch.randn(1024, dtype=torch.complex64, device="cuda", generator=g)
    return {
        "big": big,
        "bf16": torch.randn(3, 1000, device="cuda", generator=g).to(torch.bfloat16),
        "f8": torch.randn(4096, device="cuda", generator=g).to(torch.float8_e4m3fn),
        "conj": c.conj(),
        "strided": torch.randn(512, 256, device="cuda", generator=g).t(),
        "steps": torch.arange(7, device="cuda"),
        "mask": torch.rand(333, device="cuda", generator=g) > 0.5,
        "host": np.arange(10, dtype=np.float32),
    }


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v.detach().resolve_conj().cpu().clone() if isinstance(v, torch.Tensor) else v.copy()
        for k, v in state.items()
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), b)
    a = a.detach().resolve_conj().cpu()
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
    )


def test_cuda_tensors_go_straight_into_a_pinned_lease_and_later_writes_wait(
    make_daemon: Any,
) -> None:
    daemon = make_daemon()
    client = daemon.client("gpu", incremental=False)
    state = cuda_state()
    before = snapshot(state)
    handle = client.save(1, state)
    # Written on the trainer's stream at once, as the next optimizer step would: the
    # saved bytes must be those before the save returned.
    for v in state.values():
        if isinstance(v, torch.Tensor) and v.dtype in (torch.float32, torch.int64):
            v.add_(1)
    handle.wait("local", 120)
    copies = client._saver._cuda  # the lease was page-locked, not copied through pageable memory
    assert copies is not None and any(m.pinned for m in copies._mapped.values())
    tree, _ = client.restore(step=1)
    for k, v in before.items():
        assert same(tree[k], v), k


def test_restore_onto_cuda_targets_through_staging_is_bit_exact(make_daemon: Any) -> None:
    daemon = make_daemon()
    client = daemon.client("gpu-restore", incremental=False)
    g = torch.Generator().manual_seed(1)
    state = {  # over several staging buffers, one under the staging size, one tiny
        "w": torch.randn(200 * MiB // 2, generator=g).to(torch.bfloat16),
        "m": torch.randn(5 * MiB // 4, generator=g),
        "b": torch.randn(10, generator=g),
    }
    client.save(1, state).wait("local", 120)
    target = {k: torch.zeros_like(v, device="cuda") for k, v in state.items()}
    tree, _ = client.restore(step=1, target=target)
    for k, v in state.items():
        assert tree[k] is target[k] and tree[k].is_cuda
        assert same(tree[k], v), k


def test_dcp_async_save_stages_cuda_tensors_into_a_lease(make_daemon: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptd.client.torch import CkptdReader, CkptdWriter

    daemon = make_daemon()
    client = daemon.client("gpu-dcp", incremental=False)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.Linear(2048, 16)).cuda()
    state = {"model": model.state_dict()}
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    writer = CkptdWriter(client, wait="local")
    future = dcp.async_save(state, checkpoint_id=1, storage_writer=writer, no_dist=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)  # staged already: async_save returned after its stager
    future.result()
    assert writer.handoff == "in place"
    fresh = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(fresh, storage_reader=CkptdReader(client, step=1), no_dist=True)
    for k, v in before.items():
        assert torch.equal(fresh["model"][k].cpu(), v), k


def test_jax_gpu_arrays_round_trip_sharded_over_the_devices(make_daemon: Any) -> None:
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip(f"jax runs on {jax.default_backend()} here, not a GPU")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    rows = 1024 * len(devices)
    host = np.random.default_rng(2).standard_normal((rows, 4096), dtype=np.float32)
    w = jax.device_put(host, sharding)
    daemon = make_daemon()
    client = daemon.client("gpu-jax", incremental=False)
    handle = client.save(1, {"w": w, "b": jax.numpy.arange(5)})
    w2 = w + 1  # jax's next step; w itself is immutable
    handle.wait("local", 120)
    assert client._saver._via_torch  # the shards went the way of CUDA tensors (DLPack)
    target = {
        "w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding),
        "b": jax.numpy.zeros(5, int),
    }
    tree, _ = client.restore(step=1, target=target)
    assert tree["w"].sharding == sharding
    assert np.array_equal(np.asarray(tree["w"]), host)
    assert all(s.data.devices() <= set(devices) for s in tree["w"].addressable_shards)
    assert np.array_equal(np.asarray(w2), host + 1)
