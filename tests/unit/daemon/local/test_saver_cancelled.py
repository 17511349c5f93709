"""A handoff whose call is cancelled (the client died with its ``CommitShards`` in
flight: gRPC cancels the call) is carried through: the step is written or failed,
and its lease comes back. Left half done, the step stayed STAGING and its segment
leased for good, so each restart of a crash-looping trainer took new memory.

The daemon's saver runs in-process on a real catalog, staging pool, store and
journal; the journal's write is held while the call is cancelled.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from ckptd.daemon.api.requests import parse_commit
from ckptd.daemon.catalog import Catalog
from ckptd.daemon.io import IoPool
from ckptd.daemon.local.journal import Journal
from ckptd.daemon.local.saver import Saver
from ckptd.daemon.local.staging import Staging
from ckptd.daemon.local.store import LocalStore
from ckptd.proto import ckptd_pb2 as pb

MiB = 2**20
N = 1024  # float32s in the one shard


def test_a_cancelled_commit_is_still_written_and_its_lease_given_back(tmp_path: Path) -> None:
    async def body() -> None:
        root, shm = tmp_path / "root", tmp_path / "shm"
        shm.mkdir()
        store = LocalStore(root)
        store.recover()
        journal = Journal(root)
        journal.load()
        staging = Staging("ckptd-test-", 16 * MiB, 600.0, shm_dir=shm)
        catalog = Catalog("node-a")
        io = IoPool(2)
        jobs: list[asyncio.Task[None]] = []
        spawned = asyncio.Event()

        def spawn(name: str, coro: Coroutine[Any, Any, None]) -> None:
            jobs.append(asyncio.ensure_future(coro))
            spawned.set()

        saver = Saver(catalog, staging, store, io, "node-a", spawn, journal)
        entered, go_on = asyncio.Event(), asyncio.Event()
        record = journal.commit

        async def held(*args: Any) -> None:  # the journal's fsync, held by the test
            entered.set()
            await go_on.wait()
            await record(*args)

        journal.commit = held  # type: ignore[method-assign]
        lease = await staging.acquire("cut", MiB, owner=(os.getuid(), os.getpid()))
        lease.segment.view(0, 4 * N)[:] = bytes(range(256)) * (4 * N // 256)
        shard = pb.ShardDescriptor(key="w", dtype="<f4", shape=[N], global_shape=[N], length=4 * N)
        shard.index.add(start=0, stop=N)
        req = pb.CommitShardsRequest(
            lease_id=lease.lease_id, job="cut", step=1, rank=0, node_ranks=[0], world_size=1
        )
        req.shards.append(shard)
        call = asyncio.ensure_future(saver.commit(parse_commit(req), req.SerializeToString()))
        await entered.wait()
        call.cancel()  # the client is gone: its call ends here
        go_on.set()
        await asyncio.gather(call, return_exceptions=True)
        # The rank's write is started once the handoff is journaled, call or no call.
        await asyncio.wait_for(spawned.wait(), 30)
        await asyncio.gather(*jobs)
        st = catalog.get("cut", 1)
        assert st is not None and st.state == pb.SAVE_STATE_LOCAL, st
        assert staging.leases_held == 0  # the segment is free for the next life's save
        journal.close()
        io.close()
        staging.close()

    asyncio.run(body())
