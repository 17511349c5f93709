"""The training job the goodput benchmark kills and restarts (bench/goodput/run.py).

A JAX MLP on CPU trained with optax Adam on data that is a function of the step
number only, so the run is deterministic: the loss at step ``s`` is the same bits
whether the job ran straight through or was killed and resumed. Parameters plus
Adam's two moments make a state of ``--state-mib``; ``--ballast-mib`` adds an array
no step touches (the checkpoint and its restore grow, the step time does not). A
restart restores onto the state's shapes: no state is built only to be replaced.

It restores the newest checkpoint its arm can find, then trains forever,
appending to ``--progress`` (one line per event, flushed, so a SIGKILL loses
nothing written before it):

    start <unix time>                 process started (before jax is imported)
    restored <step> <unix time>       state restored (step 0: from scratch)
    restore <step> <begin> <end> <tier>
                                      the restore call alone (unix times; after a
                                      checkpoint was found): tier ``memory`` (the
                                      daemon's memory tier) or ``disk``
    step <step> <unix time> <loss>    step done; <loss> is the float32's bits in hex
    saving <step> <unix time>         the arm decided to save <step>; save() is called
    saved <step> <unix time>          a save of <step> was started (returned)
    local <step> <unix time>          Orbax's save of <step> finalized (restorable)
    policy <interval> <cost> <base> <mtbf>
                                      Goodput()'s estimates after that save (seconds)

Arms: ``noop`` (never saves), ``ckptd-continuous`` (``Continuous()``),
``ckptd-goodput`` (``Goodput(mtbf_seconds=--mtbf)``; with ``--node-mtbf``,
``Goodput(mtbf_seconds=inf, node_mtbf_seconds=--node-mtbf, stage="durable")``),
``ckptd-learned`` (``Goodput()``: the failure rate learned from the daemon's
record of the job's restarts), ``ckptd-interval`` (``FixedInterval(--interval-steps)``),
``orbax-continuous``
(``ContinuousCheckpointingPolicy``) and ``orbax-interval`` (every
``--interval-steps`` steps), Orbax with async saves on the same disk.

``--trainer gpu-like`` swaps the JAX MLP for bench/goodput/gpu_like.py's stand-in
for a GPU trainer (a fixed wait for the accelerator's compute, a small host-side
update, a device-to-host copy on each save); the event lines are the same.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

_LOG_LOCK = threading.Lock()
"""Orbax's finalization callback logs from its own thread: lines must not interleave."""


def log(out: TextIO, *fields: object) -> None:
    """Append one event line and flush it to the kernel (survives a SIGKILL)."""
    with _LOG_LOCK:
        out.write(" ".join(str(f) for f in fields) + "\n")
        out.flush()


def build(state_mib: int, seed: int, ballast_mib: int = 0) -> tuple[Any, Any, Any]:
    """(initial state function, train step, batch function) for a ~state_mib
    MiB trained state plus ``ballast_mib`` MiB no step touches (a frozen table: the
    checkpoint grows, the step time does not)."""
    import jax
    import jax.numpy as jnp
    import optax

    width = 1024
    # params + mu + nu: three float32 copies of `layers` width x width matrices.
    layers = max(1, round(state_mib * 2**20 / (3 * 4 * width * width)))
    key = jax.random.key(seed)
    tx = optax.adam(1e-4)

    def init() -> Any:
        params = {
            f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (width, width)) / width**0.5
            for i in range(layers)
        }
        state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
        if ballast_mib:
            rows = ballast_mib * 2**20 // (4 * width)
            # Distinct values, made at memory speed (random ones take seconds per GiB).
            iota = jax.jit(lambda: jnp.arange(rows * width, dtype=jnp.float32))
            state["ballast"] = iota().reshape(rows, width)
        return state

    def loss_fn(p: Any, x: Any, y: Any) -> Any:
        h = x
        for i in range(layers):
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean((h - y) ** 2)

    @jax.jit
    def update(state: Any, x: Any, y: Any) -> tuple[Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt, "step": state["step"] + 1}, loss

    def train(state: Any, x: Any, y: Any) -> tuple[Any, Any]:
        # The ballast stays out of the jitted step: passed through it, it is copied.
        trained, loss = update({k: v for k, v in state.items() if k != "ballast"}, x, y)
        return dict(state, **trained), loss

    @jax.jit
    def batch(step: Any) -> tuple[Any, Any]:
        k = jax.random.fold_in(jax.random.key(seed + 1), step)
        x = jax.random.normal(k, (256, width))
        return x, jnp.sin(x)

    return init, train, batch


class Saver:
    """The arm's checkpointing: restore the newest step; decide and start saves."""

    def __init__(self, args: argparse.Namespace, out: TextIO) -> None:
        self.arm = args.arm
        self.out = out
        self.restore_call: tuple[float, float, str] | None = None  # (begin, end, tier)
        self.client: Any = None
        self.mngr: Any = None
        self._saving: int | None = None  # the step of Orbax's save in flight
        if self.arm.startswith("ckptd"):
            from ckptd.client import Client, Continuous, FixedInterval, Goodput, SavePolicy

            policy: SavePolicy = Continuous()
            if self.arm == "ckptd-learned":
                policy = Goodput()
            elif self.arm == "ckptd-interval":
                policy = FixedInterval(args.interval_steps)
            elif self.arm == "ckptd-goodput" and args.node_mtbf:
                policy = Goodput(math.inf, node_mtbf_seconds=args.node_mtbf, stage="durable")
            elif self.arm == "ckptd-goodput":
                policy = Goodput(mtbf_seconds=args.mtbf)
            self.client = Client(args.job, socket=args.socket, policy=policy, timeout=600.0)
        elif self.arm.startswith("orbax"):
            import orbax.checkpoint as ocp

            self.ocp = ocp
            decide = (
                ocp.checkpoint_managers.ContinuousCheckpointingPolicy()
                if self.arm == "orbax-continuous"
                else ocp.checkpoint_managers.FixedIntervalPolicy(args.interval_steps)
            )
            options = ocp.CheckpointManagerOptions(
                save_decision_policy=decide,
                max_to_keep=2,
                enable_async_checkpointing=True,
                # When a save became restorable: its cost to a trainer-only failure.
                async_options=ocp.AsyncOptions(post_finalization_callback=self._finalized),
            )
            self.mngr = ocp.CheckpointManager(Path(args.dir), options=options)

    def _finalized(self) -> None:
        if self._saving is not None:
            log(self.out, "local", self._saving, time.time())

    def restore(self, state: Any, ready: Callable[[Any], Any] | None = None) -> tuple[int, Any]:
        """The newest checkpoint's (step, state) restored onto ``state`` (its shapes,
        dtypes and shardings), or (0, None); the restore call's times and tier in
        ``restore_call``. The state is ready when this returns: ``ready`` waits for it
        (default ``jax.block_until_ready``: JAX dispatches asynchronously, and a copy
        still in flight would be charged to the first step)."""
        if ready is None:
            import jax

            ready = jax.block_until_ready

        if self.client is not None:
            step = self.client.latest_step()
            if step is not None:
                # The daemon counts the restores its memory tier answered: one more
                # after this call means this one came from memory.
                before = self.client.low_level.status().memory_tier_restores
                begin = time.time()
                tree, _ = self.client.restore(step, target=state)
                ready(tree)
                end = time.time()
                hit = self.client.low_level.status().memory_tier_restores > before
                self.restore_call = (begin, end, "memory" if hit else "disk")
                return step, tree
        if self.mngr is not None:
            step = self.mngr.latest_step()
            if step is not None:
                begin = time.time()
                tree = self.mngr.restore(step, args=self.ocp.args.StandardRestore(state))
                ready(tree)
                self.restore_call = (begin, time.time(), "disk")
                return step, tree
        return 0, None

    def close(self) -> None:
        """Let the save in flight finish (a job that stops at --max-steps) and let go."""
        if self.client is not None:
            self.client.close()
        if self.mngr is not None:
            self.mngr.wait_until_finished()
            self.mngr.close()

    def maybe_save(self, step: int, state: Any) -> bool:
        """Save ``state`` (the state after ``step`` steps) if the arm's policy says so.
        ``state`` may be a function returning it: called only for a save (a GPU
        trainer's device-to-host copy, charged to the save)."""
        if self.client is not None:
            if not self.client.should_save(step):
                return False
            log(self.out, "saving", step, time.time())
            self.client.save(step, state() if callable(state) else state)
            return True
        if self.mngr is not None:
            if not self.mngr.should_save(step):
                return False
            log(self.out, "saving", step, time.time())
            # The previous save must be done before the state's host buffers are
            # written again (save() would wait for it anyway).
            self.mngr.wait_until_finished()
            self._saving = step
            tree = state() if callable(state) else state
            return bool(self.mngr.save(step, args=self.ocp.args.StandardSave(tree), force=True))
        return False


def main() -> int:
    """Restore, then train until killed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", required=True)
    ap.add_argument("--progress", type=Path, required=True)
    ap.add_argument("--socket", default=None)
    ap.add_argument("--job", default="goodput")
    ap.add_argument("--dir", default=None, help="Orbax's checkpoint directory")
    ap.add_argument("--mtbf", type=float, default=60.0, help="Goodput()'s mtbf_seconds")
    ap.add_argument("--node-mtbf", type=float, default=None,
                    help="Goodput()'s node_mtbf_seconds (the node-loss variant)")  # fmt: skip
    ap.add_argument("--interval-steps", type=int, default=10)
    ap.add_argument("--state-mib", type=int, default=256)
    ap.add_argument("--ballast-mib", type=int, default=0, help="state no step touches")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this step")
    ap.add_argument("--trainer", choices=("jax", "gpu-like"), default="jax",
                    help="jax: the JAX MLP; gpu-like: gpu_like.py's stand-in")  # fmt: skip
    ap.add_argument("--compute-seconds", type=float, default=0.5,
                    help="gpu-like: the accelerator's compute per step (a wait)")  # fmt: skip
    args = ap.parse_args()
    if args.trainer == "gpu-like" and args.ballast_mib:
        ap.error("--ballast-mib is an option of the JAX trainer only")
    out = args.progress.open("a")
    log(out, "start", time.time())
    if args.trainer == "gpu-like":
        return train_gpu_like(args, out)
    import jax

    init, train, batch = build(args.state_mib, args.seed, args.ballast_mib)
    saver = Saver(args, out)
    # A restart restores onto the state's shapes alone: building a state only to
    # overwrite it would be charged to every restart.
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
                          jax.eval_shape(init))  # fmt: skip
    step, state = saver.restore(shapes)
    if state is None:
        state = init()
    restored(out, saver, step)
    import numpy as np

    while args.max_steps is None or step < args.max_steps:
        state, loss = train(state, *batch(step))
        step += 1
        bits = np.asarray(loss, np.float32).view(np.uint32)  # waits for the step
        log(out, "step", step, time.time(), f"{int(bits):08x}")
        save(out, saver, step, state)
    saver.close()
    return 0


def train_gpu_like(args: argparse.Namespace, out: TextIO) -> int:
    """main() for ``--trainer gpu-like`` (bench/goodput/gpu_like.py)."""
    from gpu_like import GpuLike

    model = GpuLike(args.state_mib, args.seed, args.compute_seconds)
    saver = Saver(args, out)
    step, tree = saver.restore(model.device, ready=lambda t: t)  # numpy: ready at once
    if tree is None:
        model.init()
    else:
        model.load(tree)
    restored(out, saver, step)
    while args.max_steps is None or step < args.max_steps:
        bits = model.step(step)
        step += 1
        log(out, "step", step, time.time(), bits)
        save(out, saver, step, model.to_host)  # the D2H copy only if it saves
    saver.close()
    return 0


def restored(out: TextIO, saver: Saver, step: int) -> None:
    """Log the state restored (and the restore call, if a checkpoint was found)."""
    log(out, "restored", step, time.time())
    if saver.restore_call is not None:
        log(out, "restore", step, *saver.restore_call)


def save(out: TextIO, saver: Saver, step: int, state: Any) -> None:
    """Save if the arm says so, and log it (and Goodput()'s view after it)."""
    if saver.maybe_save(step, state):
        log(out, "saved", step, time.time())
        policy = saver.client.policy if saver.client is not None else None
        if getattr(policy, "save_cost_seconds", None) is not None:
            # Goodput()'s view: its interval, the save cost and base step time.
            log(out, "policy", policy.interval_seconds, policy.save_cost_seconds,
                policy.base_step_seconds, policy.mtbf_estimate_seconds)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
