"""The jax processes of a multi-host job, as ckptd's Orbax manager sees them.

Each process talks to its own node's daemon. Which processes share one (several
processes per node, or one per node) is found once, when the manager is created,
by all-gathering an identity of each process's daemon; the steps the job can
restore are those every process's daemon can restore (all-gathered, intersected),
so every process agrees on ``latest_step`` without reading a shared filesystem.
Both are collectives, at points where every process creates or reloads its
manager (as Orbax's own manager synchronises there).
"""

from __future__ import annotations

import hashlib
import socket

import numpy as np

from ..client import Client
from ..distributed import MAX_CANDIDATES, restorable_steps


def _allgather(row: np.ndarray) -> np.ndarray:
    """Every process's ``row`` (int64), one row each, in process order."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return row.reshape(1, -1)
    rows = multihost_utils.process_allgather(row)
    return np.asarray(rows).reshape(jax.process_count(), -1)


def daemon_identity(client: Client) -> int:
    """A number naming the daemon this client talks to (host, node id, root, pid)."""
    st = client.low_level.status()
    name = f"{socket.gethostname()}|{st.node_id}|{st.root}|{st.pid}".encode()
    return int.from_bytes(hashlib.sha256(name).digest()[:8], "little", signed=True)


def node_ranks(client: Client) -> list[int]:
    """The processes whose daemon is this process's (a collective)."""
    ids = _allgather(np.array([daemon_identity(client)], np.int64))[:, 0]
    return [int(i) for i in np.flatnonzero(ids == ids[client.rank])]


def agreed_steps(client: Client) -> list[int]:
    """The steps every process can restore, oldest first (a collective); at most the
    newest :data:`~ckptd.client.distributed.MAX_CANDIDATES` of each process."""
    mine = np.full(MAX_CANDIDATES, -1, np.int64)
    steps = restorable_steps(client)[:MAX_CANDIDATES]
    mine[: len(steps)] = steps
    everyone = _allgather(mine)
    common = set(everyone[0].tolist())
    for row in everyone[1:]:
        common &= set(row.tolist())
    common.discard(-1)
    return sorted(common)


def step_times(client: Client, steps: list[int]) -> dict[int, float]:
    """When each of ``steps`` was saved (this node's record, unix seconds)."""
    wanted = set(steps)
    return {c.step: c.created_unix for c in client.list() if c.step in wanted}


def process() -> tuple[int, int]:
    """``(jax.process_index(), jax.process_count())``."""
    import jax

    return int(jax.process_index()), int(jax.process_count())


def has_remote(client: Client) -> bool:
    """Whether the daemon drains to a bucket (a save can become DURABLE)."""
    status = client.low_level.status()
    return bool(status.remote)
