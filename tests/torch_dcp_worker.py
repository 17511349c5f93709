"""One rank of a gloo job saving or loading through ckptd's DCP storage (run by
test_torch_dcp.py, not by pytest).

    python -m tests.torch_dcp_worker MODE RANK WORLD PORT SOCKETS STEP EXPECTED

SOCKETS: one daemon socket for every rank, or one per rank (comma-separated: each
rank is then alone on its "node").

``plain-save`` / ``plain-load``: replicated and per-rank values, bf16, bytes items.
``fsdp-save`` / ``fsdp-load``: an FSDP2 (``fully_shard``) model and its AdamW state
through ``get_state_dict`` / ``set_state_dict``; the save writes each full tensor
to EXPECTED (rank 0), the load (on another rank count) compares bit for bit.
``fsdp-async-process``: as ``fsdp-save``, through ``async_save`` with DCP's
process executor; ``fsdp-async`` / ``plain-async``: through ``async_save`` with the
thread executor, staged straight into the daemon's shared memory (each rank prints
how its part was handed off: ``handoff in place`` or ``handoff copied``). Exit
status 0 means every check passed.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from ckptd.client.torch import CkptdReader, CkptdWriter

JOB = "dcp-mp"


def plain_state(rank: int, world: int, step: int) -> dict[str, Any]:
    """Values every rank saves (replicated: the same everywhere) and its own."""
    g = torch.Generator().manual_seed(step)
    return {
        "replicated": torch.randn(6, 5, generator=g),
        "bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "extra": {"epoch": step, "name": "plain"},
        f"rank{rank}": torch.full((3,), float(rank + world)),
    }


def model(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small FSDP2 model (6 rows over 4 ranks: one rank holds an empty shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=0.01)


def full(state: dict[str, Any]) -> dict[str, Any]:
    """Every DTensor gathered (a collective), nested dicts kept."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = full(v)
        elif isinstance(v, DTensor):
            out[k] = v.full_tensor()
        else:
            out[k] = v
    return out


def same(a: Any, b: Any, path: str = "") -> None:
    """Bit-exact equality of nested states (raises naming the first difference)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: {a.keys()} vs {b}"
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} {b}"
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def fsdp_state(world: int, train: bool) -> tuple[Any, Any, dict[str, Any]]:
    m, opt = model(world)
    if train:
        torch.manual_seed(1)
        m(torch.randn(4, 8)).sum().backward()
        opt.step()
    msd, osd = get_state_dict(m, opt)
    return m, opt, {"model": msd, "optim": osd}


def main() -> int:
    mode, rank_s, world_s, port, socket, step_s, expected = sys.argv[1:8]
    rank, world, step = int(rank_s), int(world_s), int(step_s)
    sockets = socket.split(",")
    # One socket per rank: every rank on its own node, the only rank of its daemon.
    socket, node_ranks = (sockets[rank], [rank]) if len(sockets) > 1 else (socket, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if mode in ("plain-save", "plain-async"):
            writer = CkptdWriter(JOB, socket=socket, node_ranks=node_ranks)
            if mode == "plain-save":
                dcp.save(plain_state(rank, world, step), checkpoint_id=step, storage_writer=writer)
            else:
                state = plain_state(rank, world, step)
                dcp.async_save(state, checkpoint_id=step, storage_writer=writer).result()
                print(f"rank {rank}: handoff {writer.handoff}", flush=True)
        elif mode == "plain-load":
            want = plain_state(rank, world, step)
            got = {
                k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {})
                for k, v in want.items()
            }
            got["extra"] = {"epoch": -1, "name": ""}
            dcp.load(
                got,
                checkpoint_id=f"ckptd://{JOB}/{step}",
                storage_reader=CkptdReader(JOB, socket=socket),
            )
            same(want, got)
        elif mode in ("fsdp-save", "fsdp-async", "fsdp-async-process"):
            _, _, state = fsdp_state(world, train=True)
            writer = CkptdWriter(JOB, socket=socket, node_ranks=node_ranks)
            if mode == "fsdp-save":
                dcp.save(state, checkpoint_id=step, storage_writer=writer)
            elif mode == "fsdp-async":
                dcp.async_save(state, checkpoint_id=step, storage_writer=writer).result()
                print(f"rank {rank}: handoff {writer.handoff}", flush=True)
            else:
                from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

                fut = dcp.async_save(
                    state,
                    checkpoint_id=step,
                    storage_writer=writer,
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                )
                fut.result()  # type: ignore[union-attr]
            gathered = full(state)
            if rank == 0:
                torch.save(gathered, expected)
        elif mode == "fsdp-load":
            m, opt, state = fsdp_state(world, train=False)
            dcp.load(state, checkpoint_id=step, storage_reader=CkptdReader(JOB, socket=socket))
            set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            msd, osd = get_state_dict(m, opt)
            gathered = full({"model": msd, "optim": osd})
            if rank == 0:
                same(torch.load(expected, weights_only=True), gathered)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    print(f"rank {rank}: {mode} ok", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Skip the interpreter's finalization: torch's gloo threads can abort a process
    # there after destroy_process_group ("terminate called without an active
    # exception", pytorch/pytorch#190489), rarely, once every check above has passed.
    os._exit(code)
