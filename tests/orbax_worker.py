"""A trainer using plain Orbax, run as a subprocess by tests/test_orbax.py.

    python -m tests.orbax_worker train SOCKET JOB STEPS OUT.json [fixed|continuous] [durable|local]
    python -m tests.orbax_worker restore PATH            # plain ocp.CheckpointManager(PATH)
    python -m tests.orbax_worker steps PATH              # the steps Orbax lists there
    python -m tests.orbax_worker restore-via-ckptd SOCKET JOB

``train`` uses ``ckptd.client.orbax.directory`` for the manager's directory and
nothing else of ckptd (plus ``wait`` so the test knows when the bucket has it);
it writes the steps Orbax saved and the crc32c of every file of the steps still
in its directory at the end. The restore modes print one JSON line with the
steps Orbax lists and the step restored, and fail unless every array is
bit-identical to what ``train`` saved at that step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def state_for(step: int) -> dict[str, Any]:
    """The training state at ``step`` (deterministic, so a restore can be checked)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(step)
    return {
        "params": {
            "w": jnp.asarray(rng.standard_normal((256, 1024), dtype=np.float32)),
            "b": jnp.asarray(rng.standard_normal(1000).astype(jnp.bfloat16)),
        },
        "opt": {"count": jnp.asarray(step, jnp.int32), "mu": jnp.arange(64, dtype=jnp.float32)},
        "step_ids": np.arange(16, dtype=np.int64) + step,
    }


def check(restored: Any, step: int) -> None:
    import jax

    want = jax.tree_util.tree_leaves_with_path(state_for(step))
    got = dict(jax.tree_util.tree_leaves_with_path(restored))
    for path, leaf in want:
        other = np.asarray(got[path])
        mine = np.asarray(leaf)
        assert other.dtype == mine.dtype, (path, other.dtype, mine.dtype)
        assert other.tobytes() == mine.tobytes(), f"{path} differs at step {step}"


def file_crcs(step_dir: Path) -> dict[str, int]:
    from ckptd.core.checksum import of_file as crc32c_file

    return {
        str(p.relative_to(step_dir)): crc32c_file(p)
        for p in sorted(step_dir.rglob("*"))
        if p.is_file()
    }


def train(socket: str, job: str, steps: int, out: str, continuous: bool, stage: str) -> None:
    import orbax.checkpoint as ocp

    from ckptd.client import Client
    from ckptd.client import orbax as ckptd_orbax

    client = Client(job=job, socket=socket)
    directory = ckptd_orbax.directory(client)
    policy = (
        ocp.checkpoint_managers.ContinuousCheckpointingPolicy()
        if continuous
        else ocp.checkpoint_managers.FixedIntervalPolicy(1)
    )
    options = ocp.CheckpointManagerOptions(
        max_to_keep=2, save_decision_policy=policy, best_fn=lambda m: m["loss"], best_mode="min"
    )
    saved = []
    with ocp.CheckpointManager(directory, options=options) as mngr:
        for step in range(steps):
            time.sleep(0.05)  # "training"
            args = ocp.args.StandardSave(state_for(step))
            if mngr.save(step, args=args, metrics={"loss": 100.0 - step}):
                saved.append(step)
            if not continuous:
                # Orbax deletes a step two saves later (max_to_keep=2): let ckptd see
                # each one first, so the test can check every step's fate.
                mngr.wait_until_finished()
                ckptd_orbax.wait(client, step, "local", timeout=60)
        mngr.wait_until_finished()
        left = {s: file_crcs(directory / str(s)) for s in mngr.all_steps()}
    ckptd_orbax.wait(client, saved[-1], stage, timeout=120)
    Path(out).write_text(json.dumps({"saved": saved, "files": left, "directory": str(directory)}))
    client.close()


def restore_from(path: str) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(path) as mngr:
        steps = mngr.all_steps()
        step = mngr.latest_step()
        assert step is not None, f"Orbax finds no step in {path}"
        # The state as a template: Orbax restores each leaf as the template's type.
        restored = mngr.restore(step, args=ocp.args.StandardRestore(state_for(step)))
    check(restored, step)
    return {"steps": list(steps), "restored": step}


def main() -> None:
    mode = sys.argv[1]
    if mode == "train":
        policy = sys.argv[6] if len(sys.argv) > 6 else "fixed"
        stage = sys.argv[7] if len(sys.argv) > 7 else "durable"
        train(
            sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], policy == "continuous", stage
        )
    elif mode == "restore":
        print(json.dumps(restore_from(sys.argv[2])))
    elif mode == "steps":
        import orbax.checkpoint as ocp

        with ocp.CheckpointManager(sys.argv[2]) as mngr:
            print(json.dumps({"steps": list(mngr.all_steps())}))
    elif mode == "restore-via-ckptd":
        from ckptd.client import Client
        from ckptd.client import orbax as ckptd_orbax

        client = Client(job=sys.argv[3], socket=sys.argv[2])
        directory = ckptd_orbax.directory(client)
        step = ckptd_orbax.ensure_local(client)
        result = restore_from(str(directory))
        result["ensured"] = step
        print(json.dumps(result))
        client.close()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
