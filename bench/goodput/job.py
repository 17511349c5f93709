"""The training job the goodput benchmark kills and restarts (bench/goodput/run.py).

A JAX MLP on CPU trained with optax Adam on data that is a function of the step
number only, so the run is deterministic: the loss at step ``s`` is the same bits
whether the job ran straight through or was killed and resumed. Parameters plus
Adam's two moments make a state of ``--state-mib``.

It restores the newest checkpoint its arm can find, then trains forever,
appending to ``--progress`` (one line per event, flushed, so a SIGKILL loses
nothing written before it):

    start <unix time>                 process started (before jax is imported)
    restored <step> <unix time>       state restored (step 0: from scratch)
    step <step> <unix time> <loss>    step done; <loss> is the float32's bits in hex
    saved <step> <unix time>          a save of <step> was started (returned)
    policy <interval> <cost> <base> <mtbf>
                                      Goodput()'s estimates after that save (seconds)

Arms: ``noop`` (never saves), ``ckptd-continuous`` (``Continuous()``),
``ckptd-goodput`` (``Goodput(mtbf_seconds=--mtbf)``; with ``--node-mtbf``,
``Goodput(mtbf_seconds=inf, node_mtbf_seconds=--node-mtbf, stage="durable")``),
``ckptd-learned`` (``Goodput()``: the failure rate learned from the daemon's
record of the job's restarts), ``orbax-continuous``
(``ContinuousCheckpointingPolicy``) and ``orbax-interval`` (every
``--interval-steps`` steps), Orbax with async saves on the same disk.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO


def log(out: TextIO, *fields: object) -> None:
    """Append one event line and flush it to the kernel (survives a SIGKILL)."""
    out.write(" ".join(str(f) for f in fields) + "\n")
    out.flush()


def build(state_mib: int, seed: int) -> tuple[Any, Any, Any]:
    """(initial state, jitted train step, batch function) for a ~state_mib MiB state."""
    import jax
    import jax.numpy as jnp
    import optax

    width = 1024
    # params + mu + nu: three float32 copies of `layers` width x width matrices.
    layers = max(1, round(state_mib * 2**20 / (3 * 4 * width * width)))
    key = jax.random.key(seed)
    params = {
        f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (width, width)) / width**0.5
        for i in range(layers)
    }
    tx = optax.adam(1e-4)
    state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def loss_fn(p: Any, x: Any, y: Any) -> Any:
        h = x
        for i in range(layers):
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean((h - y) ** 2)

    @jax.jit
    def train(state: Any, x: Any, y: Any) -> tuple[Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt, "step": state["step"] + 1}, loss

    @jax.jit
    def batch(step: Any) -> tuple[Any, Any]:
        k = jax.random.fold_in(jax.random.key(seed + 1), step)
        x = jax.random.normal(k, (256, width))
        return x, jnp.sin(x)

    return state, train, batch


class Saver:
    """The arm's checkpointing: restore the newest step; decide and start saves."""

    def __init__(self, args: argparse.Namespace, state: Any) -> None:
        self.arm = args.arm
        self.client: Any = None
        self.mngr: Any = None
        if self.arm.startswith("ckptd"):
            from ckptd.client import Client, Continuous, Goodput, SavePolicy

            policy: SavePolicy = Continuous()
            if self.arm == "ckptd-learned":
                policy = Goodput()
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
                save_decision_policy=decide, max_to_keep=2, enable_async_checkpointing=True
            )
            self.mngr = ocp.CheckpointManager(Path(args.dir), options=options)

    def restore(self, state: Any) -> tuple[int, Any]:
        """The newest checkpoint's (step, state), or (0, state)."""
        if self.client is not None:
            step = self.client.latest_step()
            if step is not None:
                tree, _ = self.client.restore(step, target=state)
                return step, tree
        if self.mngr is not None:
            step = self.mngr.latest_step()
            if step is not None:
                return step, self.mngr.restore(step, args=self.ocp.args.StandardRestore(state))
        return 0, state

    def maybe_save(self, step: int, state: Any) -> bool:
        """Save ``state`` (the state after ``step`` steps) if the arm's policy says so."""
        if self.client is not None:
            if self.client.should_save(step):
                self.client.save(step, state)
                return True
            return False
        if self.mngr is not None:
            return bool(self.mngr.save(step, args=self.ocp.args.StandardSave(state)))
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this step")
    args = ap.parse_args()
    out = args.progress.open("a")
    log(out, "start", time.time())
    state, train, batch = build(args.state_mib, args.seed)
    saver = Saver(args, state)
    step, state = saver.restore(state)
    log(out, "restored", step, time.time())
    import numpy as np

    while args.max_steps is None or step < args.max_steps:
        state, loss = train(state, *batch(step))
        step += 1
        bits = np.asarray(loss, np.float32).view(np.uint32)  # waits for the step
        log(out, "step", step, time.time(), f"{int(bits):08x}")
        if saver.maybe_save(step, state):
            log(out, "saved", step, time.time())
            policy = saver.client.policy if saver.client is not None else None
            if getattr(policy, "save_cost_seconds", None) is not None:
                # Goodput()'s view: its interval, the save cost and base step time.
                log(out, "policy", policy.interval_seconds, policy.save_cost_seconds,
                    policy.base_step_seconds, policy.mtbf_estimate_seconds)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
