"""MaxText's own checkpointing through ckptd (run by test_maxtext.py in .venv-maxtext:
Python 3.12, MaxText 0.2.5 (Orbax's v1 ``Checkpointer``) or 0.2.4 (v0
``CheckpointManager``) and its jax; not by pytest).

    python tests/frameworks/maxtext_worker.py train SOCKET RUN OUTDIR STEPS PERIOD SEED [HOLD]
    python tests/frameworks/maxtext_worker.py functions SOCKET RUN OUTDIR

``train``: MaxText's pre-training loop (``maxtext.trainers.pre_train.train.main``) on
a tiny decoder, synthetic data, CPU, with ``use_in_maxtext()`` as the only change:
MaxText creates its checkpoint manager, restores in ``load_state_if_possible`` and
saves in ``maybe_save_checkpoint`` as always. ``SEED``: MaxText's
``init_weights_seed`` (a resumed run given another one ends like the first run only
if it restored everything). ``HOLD``: once the save of that step returned, write
``OUTDIR/held`` and wait to be killed.

``functions``: MaxText's checkpointing functions called directly on a flax
``TrainState`` sharded over 4 devices (``create_orbax_checkpoint_manager``,
``save_checkpoint``, ``maybe_save_checkpoint``, ``load_state_if_possible``); prints a
JSON line of what it checked.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

TINY = [
    "dataset_type=synthetic",
    "hardware=cpu",
    "base_emb_dim=32",
    "base_num_query_heads=2",
    "base_num_kv_heads=2",
    "base_mlp_dim=64",
    "base_num_decoder_layers=2",
    "head_dim=16",
    "vocab_size=128",
    "max_target_length=16",
    "per_device_batch_size=1",
    "dtype=float32",
    "skip_jax_distributed_system=true",
    "enable_goodput_recording=false",
    "log_period=1000",
]


def publish(path: Path, text: str) -> None:
    """Write PATH whole or not at all: the test polls for it and reads it at once."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def hold_at(step: int, outdir: Path) -> None:
    """Test instrumentation: after ``save(step)`` returned, say so and wait to be killed."""
    from ckptd.client.orbax import manager as orbax_manager

    save = orbax_manager.CheckpointManager.save

    def holding(self: Any, step_: int, *args: Any, **kwargs: Any) -> bool:
        saved = bool(save(self, step_, *args, **kwargs))
        if saved and step_ == step:
            publish(outdir / "held", str(step))
            signal.pause()
        return saved

    orbax_manager.CheckpointManager.save = holding  # type: ignore[method-assign]


def train(socket: str, run: str, outdir: str, steps: int, period: int, seed: int, hold: int) -> int:
    from ckptd.client import orbax as ckptd_orbax

    ckptd_orbax.use_in_maxtext(socket=socket)  # the one line a MaxText user adds
    if hold >= 0:
        hold_at(hold, Path(outdir))
    import maxtext
    from maxtext.trainers.pre_train import train as maxtext_train

    config = str(Path(maxtext.__file__).parent / "configs" / "base.yml")
    argv = [
        "train",
        config,
        f"run_name={run}",
        f"base_output_directory={outdir}",
        f"steps={steps}",
        f"checkpoint_period={period}",
        f"init_weights_seed={seed}",
        *TINY,
    ]
    maxtext_train.main(argv)
    return 0


def steps_of(mngr: Any) -> list[int]:
    """The steps of MaxText's checkpointer: v1's ``checkpoints``, v0's ``all_steps()``."""
    if hasattr(mngr, "checkpoints"):
        return [c.step for c in mngr.checkpoints]
    return list(mngr.all_steps())


def functions(socket: str, run: str, outdir: str) -> int:
    import jax
    import numpy as np
    import optax
    from flax.training import train_state
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from maxtext.common import checkpointing

    from ckptd.client import orbax as ckptd_orbax

    ckptd_orbax.use_in_maxtext(socket=socket)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "fsdp"))
    params = {
        "dense": {"kernel": np.arange(64, dtype=np.float32).reshape(8, 8) / 7},
        "norm": {"scale": np.ones(8, np.float32)},
    }
    shard = {"dense": {"kernel": P("fsdp", "data")}, "norm": {"scale": P()}}
    params = jax.tree_util.tree_map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, shard
    )
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    state = state.replace(step=jax.device_put(np.int32(5), NamedSharding(mesh, P())))
    mngr = checkpointing.create_orbax_checkpoint_manager(
        f"{outdir}/{run}/checkpoints/", True, True, 5, max_num_checkpoints_to_keep=3
    )
    ours = ("ckptd.client.orbax.manager", "ckptd.client.orbax.training")
    assert type(mngr).__module__ in ours, type(mngr)
    assert checkpointing.latest_step(mngr) is None
    assert checkpointing.save_checkpoint(mngr, 5, state)
    assert not checkpointing.save_checkpoint(mngr, 7, state)  # not a multiple of 5
    checkpointing.wait_until_finished(mngr)
    assert steps_of(mngr) == [5] and checkpointing.latest_step(mngr) == 5
    assert not checkpointing.reached_preemption(mngr, 5)

    # A restarted trainer: a new manager from MaxText's own function, restoring the way
    # MaxText's setup does (an abstract TrainState carrying the shardings).
    again = checkpointing.create_orbax_checkpoint_manager(
        f"{outdir}/{run}/checkpoints/", True, True, 5
    )
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    restored, params_only = checkpointing.load_state_if_possible(
        again, None, "", "", 96, abstract, dataset_type="synthetic"
    )
    assert params_only is None
    got = restored["items"]
    assert type(got) is type(state), type(got)
    same = jax.tree_util.tree_map(
        lambda a, b: bool(
            np.array_equal(np.asarray(a), np.asarray(b)) and a.sharding == b.sharding
        ),
        got,
        state,
    )
    assert all(jax.tree_util.tree_leaves(same)), same
    print(json.dumps({"steps": steps_of(again), "restored_step": int(got.step)}))
    again.close()
    mngr.close()
    return 0


def main() -> int:
    mode, socket, run, outdir, *rest = sys.argv[1:]
    if mode == "train":
        steps, period, seed = int(rest[0]), int(rest[1]), int(rest[2])
        hold = int(rest[3]) if len(rest) > 3 else -1
        return train(socket, run, outdir, steps, period, seed, hold)
    return functions(socket, run, outdir)


if __name__ == "__main__":
    sys.exit(main())
