"""jax leaves of an incremental step restored onto other shardings, bit-exact."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ckptd.client.leaves.jax_arrays import build_leaf  # noqa: E402
from ckptd.client.shards import ShardReader  # noqa: E402
from ckptd.core.format import dtype_to_str  # noqa: E402
from ckptd.core.manifest import MANIFEST  # noqa: E402

from .conftest import Daemon  # noqa: E402
from .test_incremental_readers import incremental  # noqa: E402, F401

pytestmark = pytest.mark.usefixtures("incremental")  # every save asks for an increment

SPECS = {"w": P("x", "y"), "b": P("y"), "rep": P()}
ONTO = {"w": P("y", "x"), "b": P("x"), "rep": P("x")}


def mesh(shape: tuple[int, int]) -> Mesh:
    return Mesh(np.array(jax.devices()[: shape[0] * shape[1]]).reshape(shape), ("x", "y"))


def host_states() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(11)
    one = {
        "w": rng.standard_normal((64, 96)).astype(np.float32),
        "b": rng.standard_normal((96,)).astype(np.float32),
        "rep": np.arange(1024, dtype=np.int32),
    }
    return one, {**one, "b": one["b"] + 1}


def on(m: Mesh, host: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: jax.device_put(v, NamedSharding(m, SPECS[k])) for k, v in host.items()}


def target(m: Mesh, host: dict[str, np.ndarray]) -> dict[str, Any]:
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(m, ONTO[k]))
        for k, v in host.items()
    }


def test_incremental_jax_step_restores_onto_other_shardings(
    disk_daemon: Daemon,
) -> None:
    client = disk_daemon.client("jinc")
    one, two = host_states()
    client.save(1, on(mesh((2, 2)), one)).wait("local", 60)
    client.save(2, on(mesh((2, 2)), two)).wait("local", 60)
    manifest = json.loads((disk_daemon.root / "jinc" / "2" / MANIFEST).read_text())
    assert {r[2] for r in manifest["ranks"][0]["refs"]} == {1}
    for shape in [(4, 1), (1, 4), (1, 1)]:
        want = target(mesh(shape), two)
        tree, _ = client.restore(target=want, shared_memory=False)
        for k, v in two.items():
            got = tree[k]
            assert isinstance(got, jax.Array) and got.sharding == want[k].sharding
            assert np.asarray(got).tobytes() == v.tobytes(), (shape, k)


def test_shard_reader_builds_incremental_jax_leaves_from_the_files(
    disk_daemon: Daemon,
) -> None:
    """What a restore does for shards its own rank's buffer does not hold (another
    rank's, another node's): each read from the file holding it, and checked."""
    client = disk_daemon.client("jread")
    one, two = host_states()
    client.save(1, on(mesh((2, 2)), one)).wait("local", 60)
    client.save(2, on(mesh((2, 2)), two)).wait("local", 60)
    manifest = json.loads((disk_daemon.root / "jread" / "2" / MANIFEST).read_text())
    assert manifest["ranks"][0]["refs"]
    reader = ShardReader(str(disk_daemon.root / "jread" / "2"), manifest)
    try:
        want = target(mesh((4, 1)), two)
        for k, v in two.items():
            spec = {"jax": k, "dtype": dtype_to_str(v.dtype)}
            got = build_leaf(reader, spec, want[k])
            assert np.asarray(got).tobytes() == v.tobytes(), k
    finally:
        reader.close()
