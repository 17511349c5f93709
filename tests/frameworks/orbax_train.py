"""A jax training loop checkpointed the way MaxText does, through ckptd's Orbax
``CheckpointManager`` (run by test_orbax_manager.py, not by pytest).

    python -m tests.frameworks.orbax_train SOCKET JOB OUT [--steps N] [--hold-at K]
        [--save-every N] [--preempt-at K] [--replicas-zero]
        [--process-id I --num-processes=N --port P]

A tiny MLP (params and optax Adam state as global arrays over a 2x2 mesh, which
spans the processes of a multi-process job), a typed PRNG key, data derived from
the step. The train step donates its state (``donate_argnums``, as MaxText's does).
At start it restores the newest step like MaxText's ``load_state_if_possible``
(``PyTreeRestore`` with ``restore_args`` carrying each leaf's sharding); it saves
``Composite(items=PyTreeSave, meta=JsonSave)`` every 3 steps. ``--hold-at K``: after
step K's save returned, write ``OUT.held<process>`` and wait to be killed. At the end,
process 0 writes every leaf of the final state (gathered whole) to ``OUT.npz`` and a
summary to ``OUT.json``. ``--preempt-at K``: SIGTERM itself after step K (with
``--port``: ``jax.distributed``, whose preemption notifier catches it); at the step
jax's preemption sync point is reached the manager saves, the loop waits for it and
stops, as MaxText's does. ``--replicas-zero``: save replica 0 of each shard only
(``replicas=False``, as Orbax), not each distinct shard a process holds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

# Before jax is imported: 4 CPU devices, 2 a process in a two-process job.
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=" + (
    "2" if "--num-processes=2" in sys.argv else "4"
)

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ckptd.client import orbax as ckptd_orbax

SAVE_EVERY = 3
WIDTH = 16


def publish(path: Path, text: str) -> None:
    """Write PATH whole or not at all: the test polls for it and reads it at once."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def init(mesh: Mesh) -> dict[str, Any]:
    """The initial state, computed on the mesh (a global array in a multi-process job)."""
    return jax.jit(fresh, out_shardings=shardings(jax.eval_shape(fresh), mesh))()  # type: ignore[no-any-return]


def fresh() -> dict[str, Any]:
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (WIDTH, WIDTH), jnp.float32) / 4,
        "w2": jax.random.normal(k2, (WIDTH, 1), jnp.float32) / 4,
        "b1": jnp.zeros((WIDTH,), jnp.float32),
    }
    return {
        "params": params,
        "opt_state": optax.adam(1e-2).init(params),
        "step": jnp.zeros((), jnp.int32),
        "rng": jax.random.key(7),
    }


def shardings(state: Any, mesh: Mesh) -> Any:
    """Matrices split by rows over "x" and columns over "y" where they divide; the
    rest replicated."""

    def one(x: Any) -> NamedSharding:
        if getattr(x, "ndim", 0) == 2 and x.shape[1] % 2 == 0:
            return NamedSharding(mesh, P("x", "y"))
        if getattr(x, "ndim", 0) == 2:
            return NamedSharding(mesh, P("x", None))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map(one, state)


def loss(params: dict[str, Any], x: jax.Array, y: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def train_step(state: dict[str, Any]) -> dict[str, Any]:
    rng, data = jax.random.split(state["rng"])
    x = jax.random.normal(data, (8, WIDTH), jnp.float32)
    y = jnp.sum(x, axis=1, keepdims=True)
    grads = jax.grad(loss)(state["params"], x, y)
    updates, opt_state = optax.adam(1e-2).update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": rng}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("socket")
    ap.add_argument("job")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--hold-at", type=int, default=-1)
    ap.add_argument("--save-every", type=int, default=SAVE_EVERY)
    ap.add_argument("--preempt-at", type=int, default=-1)
    ap.add_argument("--replicas-zero", action="store_true")
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    if a.port:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            f"127.0.0.1:{a.port}", num_processes=a.num_processes, process_id=a.process_id
        )
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    mngr = ckptd_orbax.CheckpointManager(
        f"/outputs/{a.job}/checkpoints",
        item_names=("items", "meta"),
        options=ocp.CheckpointManagerOptions(save_interval_steps=a.save_every, max_to_keep=3),
        socket=a.socket,
        replicas=False if a.replicas_zero else "process",
    )
    state = init(mesh)
    start = mngr.latest_step()
    if start is not None:  # MaxText's load_state_if_possible
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
        restore_args = jax.tree_util.tree_map(
            lambda x: ocp.type_handlers.ArrayRestoreArgs(sharding=x.sharding), abstract
        )
        restored = mngr.restore(
            start,
            args=ocp.args.Composite(
                items=ocp.args.PyTreeRestore(
                    item=abstract, restore_args=restore_args, partial_restore=True
                ),
                meta=ocp.args.JsonRestore(),
            ),
        )
        state = restored["items"]
        assert restored["meta"]["step"] == start == int(state["step"]), restored["meta"]
    step_fn = jax.jit(train_step, donate_argnums=0)
    saved, preempted = [], None
    for _ in range(start or 0, a.steps):
        state = step_fn(state)
        step = int(state["step"])
        args = ocp.args.Composite(
            items=ocp.args.PyTreeSave(state),
            meta=ocp.args.JsonSave({"step": step}),
        )
        if mngr.save(step, args=args):
            saved.append(step)
            if step == a.hold_at:
                held = {"step": step, "start": start, "process": a.process_id}
                publish(Path(f"{a.out}.held{a.process_id}"), json.dumps(held))
                signal.pause()  # the test kills this process now
        if step == a.preempt_at:
            os.kill(os.getpid(), signal.SIGTERM)  # jax's preemption notifier catches it
        if mngr.reached_preemption(step):  # MaxText: wait for the save, stop training
            mngr.wait_until_finished()
            preempted = step
            break
    mngr.wait_until_finished()
    leaves = jax.tree_util.tree_leaves(state)
    whole = [
        multihost_utils.process_allgather(
            jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
            tiled=True,
        )
        for x in leaves
    ]
    if a.process_id == 0:
        np.savez(a.out + ".npz", *[np.asarray(w) for w in whole])
        summary = {"start": start, "saved": saved, "preempted": preempted}
        Path(a.out + ".json").write_text(json.dumps(summary))
    mngr.close()
    if a.port:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
