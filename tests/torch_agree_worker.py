"""One process of a two-process torch.distributed (gloo) job that asks its node's
daemon which steps it can restore and agrees with the other process on one.

argv: rank, port, socket, out-file. Writes the agreed step (or "none") to out-file.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from ckptd.client import Client
from ckptd.client.distributed import agree_on_step


def main() -> None:
    rank, port, socket, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        with Client("agree", socket=socket, rank=rank, node_ranks=[rank], world_size=2) as c:
            step = agree_on_step(c)
        with open(out, "w") as f:
            f.write("none" if step is None else str(step))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
