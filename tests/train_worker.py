"""A flax + optax training loop that checkpoints with ckptd natively (used by
test_train_resume.py, in-process for the uninterrupted reference and as a child).

    python -m tests.train_worker SOCKET MESH STEPS OUT   # MESH: 1x1, 2x2, 4x1

The child restores the newest step if there is one (onto its own mesh), trains to
STEPS, saving whenever ``client.should_save`` says so (every SAVE_EVERY steps), and
writes the final state to OUT. With ``CKPTD_STOP_AFTER_SAVES=n`` it prints
``saved <step>`` after each ``save()`` returns and, after the n-th, waits on stdin
for the SIGKILL its parent sends on reading that line.
"""

from __future__ import annotations

import os
import sys
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ckptd.client import Client, FixedInterval

BATCH = 8
SAVE_EVERY = 4


class TrainState(train_state.TrainState):
    """flax's TrainState plus the dropout key (a typed key, saved as key data)."""

    rng: jax.Array


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: Any, train: bool) -> Any:
        x = nn.relu(nn.Dense(16)(x))
        x = nn.Dropout(0.25, deterministic=not train)(x)
        return nn.Dense(4)(x)


def make_mesh(shape: str) -> Mesh:
    rows, cols = (int(n) for n in shape.split("x"))
    return Mesh(np.array(jax.devices()[: rows * cols]).reshape(rows, cols), ("x", "y"))


def spec_for(a: Any) -> P:
    """2-D arrays over both mesh axes, vectors over y, scalars and keys replicated."""
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) or a.ndim == 0:
        return P()
    return P("x", "y") if a.ndim == 2 else P("y")


def batch(offset: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch at this data-loader offset (the offset is checkpointed state)."""
    rng = np.random.default_rng(offset)
    x = rng.standard_normal((BATCH, 8)).astype(np.float32)
    return x, np.tanh(x[:, :4] * 2.0)


def create(mesh: Mesh) -> dict[str, Any]:
    """The initial state, each array placed on ``mesh``."""
    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, 8)), train=False)["params"]
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 3, 40, 1e-3)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-2))
    state = TrainState.create(
        apply_fn=model.apply, params=params, tx=tx, rng=jax.random.key(42, impl="threefry2x32")
    )
    state = state.replace(step=jnp.asarray(0, jnp.int32))
    placed = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec_for(a))), state)
    return {"train": placed, "data_offset": 0}


def stepper(mesh: Mesh, like: Any) -> Any:
    """The train step. Its math runs replicated (every device computes the whole step
    from a replicated copy): a partitioned step reduces in an order that depends on
    the mesh, and a run resumed on another mesh is compared bit for bit. Between
    steps the state lives sharded, which is what save and restore see."""
    shardings = jax.tree.map(lambda a: NamedSharding(mesh, spec_for(a)), like)
    whole = jax.tree.map(lambda _: NamedSharding(mesh, P()), like)

    def step(state: TrainState, x: Any, y: Any) -> TrainState:
        rng, dropout = jax.random.split(state.rng)

        def loss(params: Any) -> Any:
            out = state.apply_fn({"params": params}, x, train=True, rngs={"dropout": dropout})
            return jnp.mean((out - y) ** 2)

        return state.apply_gradients(grads=jax.grad(loss)(state.params)).replace(rng=rng)

    jitted = jax.jit(step, out_shardings=whole)

    def run(state: TrainState, x: Any, y: Any) -> TrainState:
        return jax.device_put(jitted(jax.device_put(state, whole), x, y), shardings)

    return run


def train(mesh: Mesh, steps: int, client: Client | None, stop_after: int = 0) -> dict[str, Any]:
    """Train to ``steps``; with a client, resume from its newest step and save as it says."""
    state = create(mesh)
    if client is not None and client.list():
        state, _ = client.restore(target=state)  # the target's types, dtypes and mesh
        print(f"resumed {int(state['train'].step)}", flush=True)
    step_fn = stepper(mesh, state["train"])
    saves = 0
    while int(state["train"].step) < steps:
        x, y = batch(state["data_offset"])
        state = {"train": step_fn(state["train"], x, y), "data_offset": state["data_offset"] + 1}
        step = int(state["train"].step)
        if client is not None and client.should_save(step):
            client.save(step, state)
            saves += 1
            print(f"saved {step}", flush=True)
            if saves == stop_after:
                sys.stdin.readline()  # the parent SIGKILLs us now
    return state


def flat(state: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every leaf by its key path, typed keys as their key data."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out


def main() -> int:
    socket, mesh_shape, steps, out = sys.argv[1:5]
    mesh = make_mesh(mesh_shape)
    with Client("train", socket, policy=FixedInterval(SAVE_EVERY)) as client:
        state = train(mesh, int(steps), client, int(os.environ.get("CKPTD_STOP_AFTER_SAVES", 0)))
        for leaf in jax.tree.leaves(state["train"]):
            assert leaf.sharding.mesh.devices.shape == mesh.devices.shape
        assert type(state["train"]) is TrainState
        np.savez(out, **flat(state))
    return 0


if __name__ == "__main__":
    sys.exit(main())
