"""The trainer processes of ``bench_restart.py`` (and DLRover's stand-in agent).

Run as a script, one role per process::

    python bench/restart_trainer.py save    '<json config>'   # save, report, wait for SIGKILL
    python bench/restart_trainer.py restore '<json config>'   # restore, report, exit
    python bench/restart_trainer.py agent                     # DLRover's checkpoint saver

The state is read from a raw image file the driver wrote once (its layout in a JSON
file beside it), so no trainer spends seconds generating random numbers. Every
restarted trainer imports torch first, as a PyTorch trainer does, whichever library
restores it (the saving trainers of the ckptd arms skip it: they are not timed). This
module imports only numpy, torch and the arm's own library (the DLRover arm runs it
in its own virtual environment, which has no ckptd), plus ``floors``.

The restore reports monotonic clock readings (``CLOCK_MONOTONIC``, one clock for the
whole machine) so that the driver can time the restart from its own spawn.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

T_START = time.clock_gettime(time.CLOCK_MONOTONIC)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floors import touch  # noqa: E402

Tree = dict[str, Any]


def now() -> float:
    """The machine-wide monotonic clock (comparable across processes)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# -- the state -----------------------------------------------------------------
def put(tree: Tree, path: list[str], value: Any) -> None:
    """Set ``tree[path[0]]...[path[-1]] = value``, creating the dicts on the way."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def get(tree: Any, path: list[str]) -> Any:
    """``tree[path[0]]...[path[-1]]``."""
    for key in path:
        tree = tree[key]
    return tree


def load_state(cfg: dict[str, Any]) -> tuple[np.ndarray, Tree]:
    """``(image, tree)``: the image read into this process's memory and the nested dict
    of numpy views over it that the layout describes."""
    image = np.fromfile(cfg["image"], dtype=np.uint8)
    layout = json.loads(Path(cfg["layout"]).read_text())
    tree: Tree = {}
    for a in layout["arrays"]:
        count = int(np.prod(a["shape"]))
        view = np.frombuffer(image, a["dtype"], count, a["offset"]).reshape(a["shape"])
        put(tree, a["path"], view)
    return image, tree


def as_numpy(x: Any) -> np.ndarray:
    """A numpy view of a numpy array or a CPU tensor."""
    return x if isinstance(x, np.ndarray) else x.numpy()


def leaves(tree: Any, cfg: dict[str, Any]) -> list[np.ndarray]:
    """The restored leaves as numpy arrays, in the layout's order."""
    layout = json.loads(Path(cfg["layout"]).read_text())
    return [as_numpy(get(tree, a["path"])) for a in layout["arrays"]]


def check(tree: Any, cfg: dict[str, Any]) -> None:
    """Raise unless every restored leaf holds the image's bytes (untimed)."""
    image, state = load_state(cfg)
    layout = json.loads(Path(cfg["layout"]).read_text())
    for a in layout["arrays"]:
        want, got = get(state, a["path"]), as_numpy(get(tree, a["path"]))
        if want.shape != got.shape or not np.array_equal(want.view(np.uint8), got.view(np.uint8)):
            raise AssertionError(
                f"{cfg['arm']}: {'/'.join(a['path'])} differs from the saved state"
            )
    del image


def tensors(tree: Tree) -> Tree:
    """The same nested dict with ``torch.from_numpy`` views (no copy)."""
    import torch

    return {k: tensors(v) if isinstance(v, dict) else torch.from_numpy(v) for k, v in tree.items()}


# -- DLRover ---------------------------------------------------------------------
def dlrover_checkpointer(cfg: dict[str, Any]) -> Any:
    """DLRover's ``DdpCheckpointer`` (flash checkpoint, full state on local rank 0);
    the environment (``ROLE_NAME=dlrover-trainer``, ``TORCHELASTIC_RUN_ID``) was set by
    the driver so that it talks to the agent's saver rather than forking its own."""
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

    return DdpCheckpointer(cfg["dir"])


def dlrover_step(ck: Any) -> int:
    """The step DLRover's shared memory holds (its engine's own record)."""
    from dlrover.python.elastic_agent.torch.ckpt_saver import CheckpointConfig

    return int(ck._engine._shm_handler.get_checkpoint_config(CheckpointConfig()).step)


def agent() -> None:
    """What ``dlrover-run``'s agent does for flash checkpoints on this node: start the
    saver factory (it creates the saver when a trainer asks), then, on ``reset`` (a
    worker restart), release the shared memory's locks as the agent does before it
    restarts workers. Lines on stdin in, ``ok`` out."""
    from dlrover.python.elastic_agent.torch.ckpt_saver import AsyncCheckpointSaver

    AsyncCheckpointSaver.start_async_saving_ckpt()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "reset":
            AsyncCheckpointSaver.reset()
        print("ok", flush=True)


# -- the roles ---------------------------------------------------------------------
def save(cfg: dict[str, Any]) -> dict[str, Any]:
    """Save the state as ``cfg["step"]`` with the arm's library; returns once it is LOCAL
    (ckptd), in shared memory (DLRover) or written and fsynced (DCP)."""
    arm, step = cfg["arm"], int(cfg["step"])
    _image, state = load_state(cfg)
    out: dict[str, Any] = {}
    t0 = now()
    if arm.startswith("ckptd"):
        from ckptd.client import Client

        client = Client(cfg["job"], socket=cfg["socket"], timeout=600.0)
        t0 = now()
        handle = client.save(step, state, metadata={"bench_step": step})
        out["save_s"] = now() - t0
        handle.wait("local", timeout=600)
    elif arm == "dlrover":
        from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType

        ck = dlrover_checkpointer(cfg)
        t0 = now()
        ck.save_checkpoint(step, tensors(state), storage_type=StorageType.MEMORY)
        if dlrover_step(ck) != step:
            raise RuntimeError(f"DLRover skipped the save of step {step} to memory")
    elif arm == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(tensors(state), storage_writer=dcp.FileSystemWriter(cfg["dir"]))
    else:
        raise ValueError(f"unknown arm {arm!r}")
    out["saved_s"] = now() - t0
    return out


def restore(cfg: dict[str, Any]) -> dict[str, Any]:
    """Restore the newest step: torch imported, the library set up, then the timed call
    until the state is in hand, then every byte read (``floors.touch``); checked
    untimed afterwards."""
    import torch  # a PyTorch trainer imports torch before anything else

    t_imported = now()
    arm, step = cfg["arm"], int(cfg["step"])
    got_step: int | None = None
    if arm.startswith("ckptd"):
        from ckptd.client import Client

        client = Client(cfg["job"], socket=cfg["socket"], timeout=600.0)
        # What a restarting trainer asks first (is there a step to resume?): the
        # connection is set up here, as DLRover's checkpointer connects to its agent.
        if client.latest_step() is None:
            raise RuntimeError("ckptd lists no step to resume from")
        t0 = now()
        tree, meta = client.restore()
        t1 = now()
        got_step = meta.get("bench_step")
    elif arm == "dlrover":
        ck = dlrover_checkpointer(cfg)
        t0 = now()
        tree = ck.load_checkpoint()
        t1 = now()
        got_step = dlrover_step(ck)
        if not tree:
            raise RuntimeError("DLRover found no state in memory (it would read the disk)")
    elif arm == "dcp":
        import torch.distributed.checkpoint as dcp

        # The restarted trainer's model: allocated and written before the load, which
        # fills it in place (DCP loads into existing tensors).
        layout = json.loads(Path(cfg["layout"]).read_text())
        tree = {}
        for a in layout["arrays"]:
            put(tree, a["path"], torch.zeros(a["shape"], dtype=getattr(torch, a["dtype"])))
        t0 = now()
        dcp.load(tree, storage_reader=dcp.FileSystemReader(cfg["dir"]))
        t1 = now()
        got_step = step  # one directory per step: the driver names it
    else:
        raise ValueError(f"unknown arm {arm!r}")
    touch(leaves(tree, cfg))
    t2 = now()
    if got_step != step:
        raise RuntimeError(f"{arm}: restored step {got_step}, expected {step}")
    check(tree, cfg)
    return {
        "t_start": T_START,
        "t_imported": t_imported,
        "t_call": t0,
        "t_restored": t1,
        "t_touched": t2,
        "restore_s": t1 - t0,
        "touched_s": t2 - t0,
    }


def main() -> None:
    """``save`` / ``restore`` with a JSON config, or ``agent``."""
    role = sys.argv[1]
    if role == "agent":
        agent()
        return
    cfg = json.loads(sys.argv[2])
    if role == "save":
        print(json.dumps(save(cfg)), flush=True)
        while True:  # a trainer that goes on training until the driver SIGKILLs it
            time.sleep(3600)
    print(json.dumps(restore(cfg)), flush=True)
    # Exit at once: tearing down torch and the mapped state is no part of a restore.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
