"""torchtitan's own Trainer on CPU, for the tests: ``torchrun ... torchtitan_train.py
--module tests.frameworks.torchtitan_config --config tiny_llama3 <torchtitan flags>``.

What ``torchtitan.train.main`` does (parse the config, build the Trainer, train, close),
after three adaptations without which torchtitan 0.3.0 does not run on a CPU-only
torch 2.13 (nothing else of torchtitan is replaced):

- ``torchtitan.tools.utils`` falls back to device type ``"cuda"`` when no accelerator
  is found, and calls CUDA-only functions of the device module (``set_device``,
  ``get_device_name``, ``memory_stats``...): here the device is ``"cpu"`` and those
  functions answer for the CPU;
- the Trainer calls ``torch.distributed.set_timeout`` after its first step, which
  torch 2.13 does not have: here it is torch's ``_set_pg_timeout``;
- (outside this file) torchtitan's models import ``triton``, which CPU builds of
  torch do not install.

For the tests, the environment adds: ``CKPTD_TT_OUT`` (a directory: each rank writes
``resumed-<rank>`` with the step it resumed from, and ``final-<rank>.pt`` with its
model and optimizer state after the last step) and ``CKPTD_TT_KILL_AFTER_SAVE=<step>``
(each rank SIGKILLs itself as soon as the checkpointer's save of that step returns,
after writing ``saved-<rank>``).
"""

from __future__ import annotations

import os
import signal
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def publish(path: Path, text: str) -> None:
    """Write PATH whole or not at all: the test polls for it and reads it at once."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def adapt_to_cpu() -> None:
    """The device and timeout adaptations above (before torchtitan's trainer imports)."""
    import torchtitan.tools.utils as tt_utils  # type: ignore[import-untyped]

    if tt_utils.device_type == "cpu":
        return
    cpu = types.ModuleType("torchtitan_cpu_device")
    cpu.__dict__.update({k: getattr(torch.cpu, k) for k in dir(torch.cpu) if k[:2] != "__"})
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu.__dict__.update(
        set_device=lambda *a: None,
        current_device=lambda: 0,
        device_count=lambda: 1,
        get_device_name=lambda *a: "cpu",
        get_device_properties=lambda *a: types.SimpleNamespace(total_memory=total),
        reset_peak_memory_stats=lambda *a: None,
        empty_cache=lambda: None,
        memory_stats=lambda *a: {},
    )
    tt_utils.device_type, tt_utils.device_module = "cpu", cpu
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]


def _local(x: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return x.to_local().detach().clone()
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _local(v) for k, v in x.items()}
    return x


def main(argv: list[str]) -> None:
    """Parse torchtitan's flags, build its Trainer, train (with the test's hooks), close."""
    adapt_to_cpu()
    from torchtitan.config import ConfigManager  # type: ignore[import-untyped]
    from torchtitan.tools.logging import init_logger  # type: ignore[import-untyped]

    init_logger()
    config = ConfigManager().parse_args(argv)
    trainer = config.build()
    out = Path(os.environ["CKPTD_TT_OUT"])
    rank = dist.get_rank()
    kill_at = int(os.environ.get("CKPTD_TT_KILL_AFTER_SAVE", "-1"))
    checkpointer = trainer.checkpointer
    load, save = checkpointer.load, checkpointer.save

    def load_and_record(step: int = -1) -> bool:
        loaded = bool(load(step))
        publish(out / f"resumed-{rank}", str(trainer.step if loaded else -1))
        return loaded

    def save_then_maybe_die(curr_step: int, last_step: bool = False) -> bool:
        saved = bool(save(curr_step, last_step))
        if saved and curr_step == kill_at:
            publish(out / f"saved-{rank}", str(curr_step))
            os.kill(os.getpid(), signal.SIGKILL)
        return saved

    checkpointer.load, checkpointer.save = load_and_record, save_then_maybe_die
    try:
        trainer.train()
        final = {
            "step": trainer.step,
            "model": _local(trainer.model_parts[0].state_dict()),
            "optim": _local(trainer.optimizers.state_dict()),
        }
        torch.save(final, out / f"final-{rank}.pt")
    finally:
        trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
