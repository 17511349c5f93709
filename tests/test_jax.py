"""jax.Array leaves: sharded saves, replicas stored once, restore onto other shardings."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ckptd.proto import ckptd_pb2 as pb  # noqa: E402

from .conftest import Daemon  # noqa: E402


def mesh(shape: tuple[int, ...], names: tuple[str, ...] = ("x", "y")) -> Mesh:
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names[: len(shape)])


def state_on(m: Mesh) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    host = {
        "w": rng.standard_normal((8, 12)).astype(np.float32),
        "b": rng.standard_normal((12,)).astype(ml_dtypes.bfloat16),
        "f8": rng.standard_normal((4, 4)).astype(ml_dtypes.float8_e4m3fn),
        "rep": np.arange(6, dtype=np.int32),
        "scalar": np.array(3.5, dtype=np.float32),
    }
    specs = {"w": P("x", "y"), "b": P("y"), "f8": P(None, "x"), "rep": P(), "scalar": P()}
    return {k: jax.device_put(v, NamedSharding(m, specs[k])) for k, v in host.items()}, host


def test_four_devices_are_there() -> None:
    assert len(jax.devices()) >= 4, "tests/conftest.py sets XLA_FLAGS before jax is imported"


def test_2x2_sharded_state_restores_onto_other_meshes(daemon: Daemon) -> None:
    client = daemon.client("jx")
    state, host = state_on(mesh((2, 2)))
    handle = client.save(1, {"params": state, "step": 1})
    handle.wait("local", 60)
    assert handle.copied() and handle.state() == "LOCAL"
    manifest_keys = sorted(c.num_shards for c in client.list())
    # w: 4 shards; b over y: 2 distinct (replicated over x: stored once each); f8 over x: 2;
    # rep and scalar: fully replicated, stored once.
    assert manifest_keys == [4 + 2 + 2 + 1 + 1]

    tree, _ = client.restore()  # no target: numpy arrays of the global shape
    for k, v in host.items():
        assert tree["params"][k].dtype == v.dtype and tree["params"][k].tobytes() == v.tobytes()
    assert tree["step"] == 1
    tree["params"]["w"][0, 0] = 42.0  # restored numpy arrays are the caller's to update

    for shape in [(4, 1), (1, 4), (1, 1)]:
        m = mesh(shape)
        specs = {"w": P("x", "y"), "b": P("x"), "f8": P("y", None), "rep": P(), "scalar": P()}
        target = {
            "params": {
                k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(m, specs[k]))
                for k, v in host.items()
            },
            "step": None,
        }
        tree, _ = client.restore(target=target)
        for k, v in host.items():
            got = tree["params"][k]
            assert isinstance(got, jax.Array) and got.sharding == target["params"][k].sharding
            assert np.asarray(got).tobytes() == v.tobytes(), (shape, k)


def test_single_device_target_from_arrays(daemon: Daemon) -> None:
    client = daemon.client("jx1")
    state, host = state_on(mesh((2, 2)))
    client.save(3, state).wait("local", 60)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = {k: jax.device_put(np.zeros_like(v), one) for k, v in host.items()}
    tree, _ = client.restore(target=like)
    for k, v in host.items():
        assert tree[k].sharding == one and np.asarray(tree[k]).tobytes() == v.tobytes()


def test_save_replicas_and_bad_targets(daemon: Daemon) -> None:
    client = daemon.client("jx2", save_replicas=True)
    m = mesh((2, 2))
    rep = jax.device_put(np.arange(8.0), NamedSharding(m, P()))
    client.save(1, {"r": rep}).wait("local", 60)
    assert client.list()[0].num_shards == 4  # every replica, as asked
    tree, _ = client.restore()
    assert np.array_equal(tree["r"], np.arange(8.0))
    bad = {"r": jax.ShapeDtypeStruct((9,), np.float64, sharding=NamedSharding(m, P()))}
    with pytest.raises(ValueError, match="shape"):
        client.restore(target=bad)
    with pytest.raises(ValueError, match="no entry 'r'"):
        client.restore(target={"other": None})


def test_a_saved_array_donated_before_its_copy_fails_the_save_saying_why(daemon: Daemon) -> None:
    """Trusted jax arrays are copied to host after save() returns; a jitted step that
    donates them first deletes their buffers: the save fails with what to do, never
    silently."""
    import threading

    from ckptd.client import SaveFailed

    client = daemon.client("donate", trust_jax_arrays=True)
    gate = threading.Event()
    client._saver._background.submit(gate.wait)  # the device copy queues behind this
    try:
        x = jax.numpy.arange(1024.0)
        handle = client.save(1, {"x": x})
        jax.jit(lambda a: a + 1, donate_argnums=0)(x)
        assert x.is_deleted()
    finally:
        gate.set()
    with pytest.raises(SaveFailed, match=r"donated to a jitted step.*wait_copied"):
        handle.wait("local", timeout=60)
    # The commit went out while copying: the daemon drops the save on the client's
    # word that the copy failed, and its lease is back before it says FAILED.
    req = pb.GetSaveStatusRequest(
        job="donate", step=1, wait_for=pb.SAVE_STATE_LOCAL, timeout_seconds=60
    )
    assert daemon.connection.get_save_status(req, 120).state == pb.SAVE_STATE_FAILED
    assert daemon.status().leases_held == 0


def test_a_cpu_array_donated_right_after_save_is_saved_whole(daemon: Daemon) -> None:
    """By default CPU arrays are copied before save() returns (their memory may be
    shared): a step that donates them at once takes nothing from the save."""
    import threading

    client = daemon.client("donate-cpu")
    gate = threading.Event()
    client._saver._background.submit(gate.wait)  # a copy after save() would queue here
    try:
        x = jax.numpy.arange(1024.0)
        handle = client.save(1, {"x": x})
        assert handle.copied()
        jax.jit(lambda a: a + 1, donate_argnums=0)(x)
        assert x.is_deleted()
    finally:
        gate.set()
    handle.wait("local", timeout=60)
    got, _ = client.restore(step=1)
    assert np.array_equal(got["x"], np.arange(1024.0))


@pytest.mark.parametrize("trusted", [False, True])
def test_arrays_copied_to_host_in_batches_all_arrive(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, trusted: bool
) -> None:
    """A batch boundary after every array or two: each still lands in its place
    (before save() returns, or after it when trusted)."""
    from ckptd.client import copying

    monkeypatch.setattr(copying, "HOST_BATCH_BYTES", 100)
    rng = np.random.default_rng(5)
    # 40 bytes each: batches of three, and one array left for the last.
    host = {f"a{i}": rng.standard_normal(10).astype(np.float32) for i in range(10)}
    client = daemon.client("batches", trust_jax_arrays=trusted)
    client.save(1, {k: jax.numpy.asarray(v) for k, v in host.items()}).wait("local", 60)
    got, _ = client.restore(step=1)
    for k, v in host.items():
        assert np.asarray(got[k]).tobytes() == v.tobytes(), k
