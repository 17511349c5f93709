"""One process of a two-process JAX job (run by test_jax_multihost.py, not by pytest).

    python -m tests.jax_worker PROCESS_ID PORT SOCKET save|restore NUM_PROCESSES
    python -m tests.jax_worker 0 - SOCKET single 1 DEVICES

Saves a global array sharded over every process's devices, or agrees on the
step with the other processes and restores onto the same sharding; ``single``
restores alone with another device count (shards saved on other nodes come
from the bucket).
"""

from __future__ import annotations

import os
import sys

# Before jax is imported: 2 devices per process, or the count ``single`` asks for.
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=" + (
    sys.argv[6] if len(sys.argv) > 6 else "2"
)

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ckptd.client import Client
from ckptd.client.distributed import restore_agreed

SHAPE = (8, 6)


def expected(step: int) -> np.ndarray:
    """The global array saved at ``step``."""
    return np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) * (step + 1)


def main() -> int:
    pid, port, socket, mode, nproc = sys.argv[1:6]
    if mode == "single":
        return restore_alone(socket)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(nproc), process_id=int(pid))
    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("x", "y"))
    sharding = NamedSharding(mesh, P("x", "y"))
    client = Client("mh", socket, rank=int(pid), node_ranks=[int(pid)], world_size=int(nproc))
    if mode == "save":
        for step in (1, 2):
            g = expected(step)
            arr = jax.make_array_from_callback(SHAPE, sharding, lambda idx, g=g: g[idx])
            client.save(step, {"w": arr, "step": step}).wait("durable", 120)
        print(f"process {pid}: saved", flush=True)
    else:
        target = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding), "step": None}
        step, tree, _ = restore_agreed(client, target)
        assert step == 2 and tree["step"] == 2, (step, tree)
        want = expected(2)
        for shard in tree["w"].addressable_shards:
            assert np.array_equal(np.asarray(shard.data), want[shard.index]), shard.index
        print(f"process {pid}: restored step {step}", flush=True)
    jax.distributed.shutdown()
    return 0


def restore_alone(socket: str) -> int:
    """One process, its own device count: rows split over every device."""
    mesh = Mesh(np.array(jax.devices()).reshape(-1, 1), ("x", "y"))
    sharding = NamedSharding(mesh, P("x", None))
    client = Client("mh", socket)
    target = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding), "step": None}
    tree, _ = client.restore(step=2, target=target)
    assert np.array_equal(np.asarray(tree["w"]), expected(2))
    assert tree["w"].sharding == sharding and len(tree["w"].addressable_shards) == len(
        jax.devices()
    )
    print(f"alone on {len(jax.devices())} devices: restored", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
