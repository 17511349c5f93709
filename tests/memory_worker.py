"""A trainer for tests/test_memory_tier.py, run as its own process.

Usage: ``python memory_worker.py SOCKET JOB``; then one command a line on stdin,
each answered by one line on stdout:

- ``save STEP SEED``: save ``state(SEED)`` as STEP, wait until LOCAL: ``LOCAL``.
- ``dcp-save STEP SEED``: the same through ``dcp.save`` of ``torch_state(SEED)``.
- ``restore``: restore the newest step and keep the arrays: ``RESTORED <step>``.
- ``check SEED``: whether the arrays it keeps are still ``state(SEED)``: ``SAME`` or
  ``CHANGED``.
- ``corrupt``: flip one byte of the segment it last saved through (its own mapping,
  still shared with the daemon: a trainer writing through a stale mapping):
  ``CORRUPTED``.

It stays alive until killed or stdin closes.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ckptd.client import Client

MIB = 2**20


def state(seed: int) -> dict[str, np.ndarray]:
    """A deterministic state of about 3 MiB in arrays of six dtypes."""
    rng = np.random.default_rng(seed)
    return {
        "f32": rng.standard_normal(MIB // 4, dtype=np.float32).reshape(512, 512),
        "f64": rng.standard_normal(MIB // 8),
        "i8": rng.integers(-128, 127, MIB // 2, dtype=np.int8),
        "u16": rng.integers(0, 2**16, MIB // 4, dtype=np.uint16),
        "i64": rng.integers(-(2**62), 2**62, 4096, dtype=np.int64).reshape(64, 64),
        "mask": rng.integers(0, 2, 8191).astype(np.bool_),
    }


def torch_state(seed: int) -> dict[str, Any]:
    """A deterministic torch state of about 2 MiB in tensors of four dtypes."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "weight": torch.randn(512, 512, generator=g),
        "bias": torch.randn(4096, generator=g, dtype=torch.float64),
        "half": torch.randn(256, 1024, generator=g).to(torch.bfloat16),
        "steps": torch.randint(0, 2**40, (8, 64), generator=g, dtype=torch.int64),
    }


def same(tree: Any, want: dict[str, np.ndarray]) -> bool:
    """Bit-exact, dtypes and shapes included."""
    return sorted(tree) == sorted(want) and all(
        np.asarray(tree[k]).dtype == v.dtype
        and np.asarray(tree[k]).shape == v.shape
        and np.asarray(tree[k]).tobytes() == v.tobytes()
        for k, v in want.items()
    )


def main() -> None:
    socket, job = sys.argv[1:]
    client = Client(job, socket=socket)
    held: Any = None
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "save":
            step, seed = int(args[0]), int(args[1])
            client.save(step, state(seed), metadata={"step": step}).wait("local")
            out = "LOCAL"
        elif cmd == "dcp-save":  # through torch.distributed.checkpoint
            import torch.distributed.checkpoint as dcp

            from ckptd.client.torch import CkptdWriter

            step, seed = int(args[0]), int(args[1])
            dcp.save(torch_state(seed), checkpoint_id=step, storage_writer=CkptdWriter(client))
            out = "LOCAL"
        elif cmd == "restore":
            held, meta = client.restore()
            out = f"RESTORED {meta['step']}"
        elif cmd == "check":
            out = "SAME" if same(held, state(int(args[0]))) else "CHANGED"
        elif cmd == "corrupt":
            mm = list(client._handoff._segments.values())[-1]
            mm[4096] ^= 0x40
            out = "CORRUPTED"
        else:
            raise SystemExit(f"unknown command {line!r}")
        print(out, flush=True)


if __name__ == "__main__":
    main()
