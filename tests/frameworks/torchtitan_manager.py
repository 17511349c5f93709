"""torchtitan's checkpoint manager driven without its Trainer (no triton needed):
``python -m tests.frameworks.torchtitan_manager <out.json> <async_mode>...``, with
``CKPTD_SOCKET`` set. For each mode (job ``titan-<mode>``), a loop shaped like
torchtitan's (model parts, its ``OptimizersContainer`` and ``LRSchedulersContainer``,
a dataloader and train state that are ``Stateful``) saves steps 1-3 through
``CkptdCheckpointManager``, then a second manager over freshly initialised state
resumes: the latest step, then ``load_step=2``, then a step that does not exist.
Writes what it saw as JSON, per mode.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist


class Counter:
    """A ``Stateful`` dataloader / train state: the step it is at."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def parts(seed: int) -> tuple[Any, Any, Any, Counter, Counter]:
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizers = default_adamw().build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=10)
    return model, optimizers, schedulers, Counter(), Counter()


def manager(
    mode: str, seed: int, load_step: int = -1, keep_latest_k: int = 0, job: str = ""
) -> tuple[Any, tuple[Any, ...]]:
    from ckptd.client.torchtitan import CkptdCheckpointManager

    state = parts(seed)
    model, optimizers, schedulers, data, train_state = state
    config = CkptdCheckpointManager.Config(
        enable=True,
        folder=f"ckptd://{job or f'titan-{mode}'}",
        interval=1,
        async_mode=mode,
        load_step=load_step,
        initial_load_model_only=False,
        keep_latest_k=keep_latest_k,
    )
    built = config.build(
        dataloader=data,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
    )
    return built, state


def snapshot(state: tuple[Any, ...]) -> dict[str, Any]:
    model, optimizers, schedulers, data, train_state = state
    return {
        "model": [p.detach().clone() for p in model.parameters()],
        "optim": cloned(optimizers.state_dict()),
        "lr": schedulers.state_dict(),
        "counters": (data.step, train_state.step),
    }


def cloned(x: Any) -> Any:
    """``x`` with every tensor copied (a state dict's tensors are the live state)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: cloned(v) for k, v in x.items()}
    if isinstance(x, list):
        return [cloned(v) for v in x]
    return x


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def run(mode: str) -> dict[str, Any]:
    """What one async mode's saves and loads did."""
    seen: dict[str, Any] = {}
    saver, state = manager(mode, seed=0)
    model, optimizers, schedulers, data, train_state = state
    seen["fresh_start_loaded"] = saver.load()
    snaps = {}
    for step in (1, 2, 3):
        model(torch.randn(5, 8)).sum().backward()
        optimizers.step()
        schedulers.step()
        data.step = train_state.step = step
        snaps[step] = snapshot(state)
        seen[f"saved_{step}"] = saver.save(curr_step=step)
        saver.maybe_wait_for_staging()
    saver.maybe_wait_for_saving()
    saver.close()

    for load_step, want in ((-1, 3), (2, 2)):
        loader, loaded = manager(mode, seed=1, load_step=load_step)
        seen[f"loaded_{load_step}"] = loader.load(step=load_step)
        seen[f"equal_{load_step}"] = same(snapshot(loaded), snaps[want])
        seen[f"counters_{load_step}"] = [loaded[3].step, loaded[4].step]
        loader.close()
    loader, _ = manager(mode, seed=1)
    try:
        loader.load(step=9)
        seen["missing"] = "loaded"
    except FileNotFoundError as exc:
        seen["missing"] = str(exc)
    loader.close()
    return seen


def keep_latest(k: int, steps: int) -> None:
    """torchtitan's ``keep_latest_k``: ``steps`` saves of job ``titan-keep``."""
    saver, state = manager("disabled", seed=0, keep_latest_k=k, job="titan-keep")
    for step in range(1, steps + 1):
        state[3].step = state[4].step = step
        saver.save(curr_step=step)
    saver.close()


def main(out: str, modes: list[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    seen = {mode: run(mode) for mode in modes}
    keep_latest(2, 4)
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
