"""One process of a two-process JAX job (run by test_jax_multihost.py, not by pytest).

    python -m tests.jax_worker PROCESS_ID PORT SOCKET save|restore NUM_PROCESSES

Saves a global array sharded over every process's devices, or agrees on the
step with the other processes and restores onto the same sharding.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

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


if __name__ == "__main__":
    sys.exit(main())
