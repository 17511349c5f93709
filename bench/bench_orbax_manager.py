"""MaxText's checkpoint saves: ckptd's Orbax ``CheckpointManager`` (``--api v1``: its
``ocp.training.Checkpointer``) against Orbax's own.

One MaxText-shaped train state on CPU jax (a decoder's unscanned layers: attention
and MLP kernels, norms, embedding and logits; the params, Adam's ``mu`` and ``nu``,
and the step: a few hundred arrays, kernels sharded over ``--devices`` (4 CPU
devices by default, or the GPUs), norms replicated), saved the way MaxText's
``save_checkpoint`` does (``Composite(items=PyTreeSave(state))``) by two managers,
interleaved, the order alternating each repetition:

- **ckptd**: ``ckptd.client.orbax.CheckpointManager`` on a real ``ckptd serve``
  (local tier only), ``KeepLatest(2)``;
- **Orbax**: ``ocp.CheckpointManager`` with MaxText's options (async, OCDBT and
  zarr3, ``max_to_keep=2``), in a directory on the same disk;

with ``--api v1`` (MaxText 0.2.5) ckptd's ``Checkpointer`` and Orbax's
``ocp.training.Checkpointer`` (a ``Context`` with OCDBT and zarr3, ``LatestN(2)``),
saved with ``save_checkpointables_async(step, {"items": state})`` and ``wait()``.

Before each save a jitted step makes new arrays (as training does: a saved array's
host copy is cached). Per save: the save cost the trainer sees (``save()``
returning: ckptd's copies the arrays into shared memory, Orbax's transfers them to
host and starts its writer),
and the time until the step is complete on the node's disk (``wait_until_finished``:
ckptd's LOCAL, written, fsynced and renamed; Orbax's committed, not fsynced).
Medians of ``--reps`` after one warm-up each; a table on stdout and
``bench/results/orbax_manager.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

from common import (
    DEFAULT_WORK_DIR,
    Daemon,
    print_table,
    run_directory,
    settle,
    summarize,
    write_results,
)

JOB = "bench-maxtext"
OCDBT_FILE = 2 * 1024**3
"""MaxText's ``checkpoint_storage_target_data_file_size_bytes`` default."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12, help="decoder layers (default 12)")
    p.add_argument("--width", type=int, default=384, help="embedding width (default 384)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions (default 5)")
    p.add_argument("--devices", type=int, default=4, help="jax devices to shard over (default 4)")
    p.add_argument("--staging-budget", default="6GiB", help="the daemon's (default 6GiB)")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch dir (same disk)")
    p.add_argument(
        "--api",
        choices=("v0", "v1"),
        default="v0",
        help="Orbax's v0 CheckpointManager (MaxText up to 0.2.4, default) or its v1 "
        "ocp.training.Checkpointer (MaxText 0.2.5): ckptd's and Orbax's of that API",
    )
    p.add_argument("--name", default=None, help="results file bench/results/NAME.json "
                   "(default orbax_manager, or orbax_v1 with --api v1)")  # fmt: skip
    args = p.parse_args(argv)
    args.name = args.name or ("orbax_v1" if args.api == "v1" else "orbax_manager")
    if min(args.layers, args.width, args.vocab, args.reps, args.devices) < 1:
        p.error("--layers, --width, --vocab, --reps and --devices must be positive")
    return args


def make_state(args: argparse.Namespace) -> dict[str, Any]:
    """A MaxText-shaped train state: params, Adam's mu and nu, the step."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()[: args.devices]
    mesh = Mesh(np.array(devices).reshape(len(devices), 1), ("fsdp", "tensor"))
    d, mlp = args.width, 4 * args.width
    rng = np.random.default_rng(0)

    def put(shape: tuple[int, ...]) -> Any:
        spec = P("fsdp", None) if len(shape) == 2 else P()
        host = rng.standard_normal(shape, dtype=np.float32)
        return jax.device_put(host, NamedSharding(mesh, spec))

    def params() -> dict[str, Any]:
        layers = {
            f"layers_{i}": {
                "self_attention": {
                    n: {"kernel": put((d, d))} for n in ("query", "key", "value", "out")
                },
                "mlp": {
                    "wi_0": {"kernel": put((d, mlp))},
                    "wi_1": {"kernel": put((d, mlp))},
                    "wo": {"kernel": put((mlp, d))},
                },
                "pre_self_attention_layer_norm": {"scale": put((d,))},
                "post_self_attention_layer_norm": {"scale": put((d,))},
            }
            for i in range(args.layers)
        }
        return {
            "decoder": {
                **layers,
                "decoder_norm": {"scale": put((d,))},
                "logits_dense": {"kernel": put((d, args.vocab))},
            },
            "token_embedder": {"embedding": put((args.vocab, d))},
        }

    state = {
        "params": {"params": params()},
        "opt_state": [{"count": put(()), "mu": params(), "nu": params()}],
        "step": put(()),
    }
    jax.block_until_ready(state)
    return state


def run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """All repetitions; returns the samples per measurement."""
    import jax
    import orbax.checkpoint as ocp

    from ckptd.client import orbax as ckptd_orbax

    state = make_state(args)
    leaves = jax.tree_util.tree_leaves(state)
    nbytes = sum(x.nbytes for x in leaves)
    print(f"state ready: {len(leaves)} arrays, {nbytes / 2**20:.0f} MiB", flush=True)
    samples: dict[str, list[float]] = {
        k: [] for k in ("ckptd_save", "ckptd_local", "orbax_save", "orbax_done")
    }
    with Daemon(
        run_dir / "ckptd-root",
        run_dir / "ckptd.sock",
        staging_budget=args.staging_budget,
        extra_args=["--retention-local", "KeepLatest(2)"],
    ) as daemon:
        if args.api == "v1":  # MaxText 0.2.5's create_orbax_checkpoint_manager
            v1 = ocp.experimental.v1
            keep = v1.training.preservation_policies.LatestN(2)
            ctx = v1.Context()
            ctx.array.saving.use_ocdbt = ctx.array.saving.use_zarr3 = True
            ctx.array.saving.ocdbt_target_data_file_size = OCDBT_FILE
            ours = ckptd_orbax.Checkpointer(
                f"{run_dir}/{JOB}/checkpoints", preservation_policy=keep, socket=daemon.socket
            )
            theirs = v1.training.Checkpointer(
                run_dir / "orbax" / JOB / "checkpoints", context=ctx, preservation_policy=keep
            )
        else:
            ours = ckptd_orbax.CheckpointManager(
                f"{run_dir}/{JOB}/checkpoints",
                item_names=("items",),
                options=ocp.CheckpointManagerOptions(max_to_keep=2),
                socket=daemon.socket,
            )
            handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)
            theirs = ocp.CheckpointManager(
                run_dir / "orbax" / JOB / "checkpoints",
                item_names=("items",),
                item_handlers={"items": handler},
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=2, enable_async_checkpointing=True, create=True
                ),
            )

        def args_() -> Any:  # MaxText's save_checkpoint
            save_args = jax.tree_util.tree_map(
                lambda _: ocp.SaveArgs(chunk_byte_size=OCDBT_FILE), state
            )
            item = ocp.args.PyTreeSave(
                item=state, save_args=save_args, ocdbt_target_data_file_size=OCDBT_FILE
            )
            return ocp.args.Composite(items=item)

        # A train step's new arrays before each save (untimed): a saved array's host
        # copy is cached, so saving the same arrays again would skip the device-to-host
        # transfer a trainer pays every time.
        step_fn = jax.jit(lambda t: jax.tree_util.tree_map(lambda x: x + 1, t))

        def save(mngr: Any, step: int) -> tuple[float, float]:
            nonlocal state
            state = jax.block_until_ready(step_fn(state))
            settle()
            t0 = time.perf_counter()
            if args.api == "v1":  # MaxText 0.2.5's save_checkpoint (async)
                assert mngr.save_checkpointables_async(step, {"items": state}, force=True)
                t_saved = time.perf_counter()
                mngr.wait()
            else:
                assert mngr.save(step, args=args_(), force=True)
                t_saved = time.perf_counter()
                mngr.wait_until_finished()
            return t_saved - t0, time.perf_counter() - t0

        for i in range(args.reps + 1):  # the first is a warm-up, not recorded
            arms = [("ckptd", ours), ("orbax", theirs)]
            row: dict[str, float] = {}
            for name, mngr in arms if i % 2 == 0 else arms[::-1]:
                blocking, done = save(mngr, i)
                row[f"{name}_save"] = blocking
                row[f"{name}_{'local' if name == 'ckptd' else 'done'}"] = done
            if i > 0:
                for k, v in row.items():
                    samples[k].append(v)
            print(
                f"rep {i}{'' if i else ' (warm-up)'}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in row.items()),
                flush=True,
            )
        ours.close()
        theirs.close()
    devices = [str(d) for d in jax.devices()[: args.devices]]
    return {"samples": samples, "nbytes": nbytes, "arrays": len(leaves), "devices": devices}


def report(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Print the table; returns the JSON document."""
    s = {k: summarize(v) for k, v in result["samples"].items()}

    def med(k: str) -> float:
        return float(s[k]["median"])

    rows = [
        [
            "save() returns (cost the trainer sees)",
            f"{med('ckptd_save'):.3f}",
            f"{med('orbax_save'):.3f}",
            f"{med('orbax_save') / med('ckptd_save'):.2f}x",
        ],
        [
            "save() -> complete on the node's disk",
            f"{med('ckptd_local'):.3f}",
            f"{med('orbax_done'):.3f}",
            f"{med('orbax_done') / med('ckptd_local'):.2f}x",
        ],
    ]
    mib = result["nbytes"] / 2**20
    print(f"devices: {', '.join(result['devices'])}")
    print_table(
        ["median seconds", f"ckptd ({args.api})", f"Orbax ({args.api})", "Orbax / ckptd"],
        rows,
        title=f"MaxText-shaped state: {result['arrays']} arrays, {mib:.0f} MiB, {args.reps} reps",
    )
    print(
        "ckptd: complete = LOCAL (written, fsynced, renamed by the daemon); Orbax: "
        "wait_until_finished (OCDBT + zarr3, committed, not fsynced)"
    )
    return {
        "api": args.api,
        "state": {
            "arrays": result["arrays"],
            "bytes": result["nbytes"],
            "devices": result["devices"],
        },
        "layers": args.layers,
        "width": args.width,
        "vocab": args.vocab,
        "reps": args.reps,
        "results": s,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write bench/results/<name>.json."""
    args = parse_args(argv)
    with run_directory(args.dir, "orbax-manager") as run_dir:
        result = run(args, run_dir)
    doc = report(result, args)
    write_results(args.name, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
