"""The daemon's domain layer: handoffs, local commits, save states, restore choice.

Runs on the event loop; file I/O and checksums go to a thread pool. The gRPC
servicer (server.py) converts requests into calls here and errors into statuses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.client.format import ALIGN, TensorEntry, build_header, check_layout, round_up
from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import state_name

from . import localstore
from .config import Config
from .errors import Conflict, FailedPrecondition, InvalidArgument, NotFound
from .localstore import LocalStore
from .manifest import Manifest, RankRecord, ShardRecord, rank_file_name
from .requests import CommitRequest
from .staging import Lease, Staging, segment_prefix

log = logging.getLogger("ckptd.node")

MAX_WAIT_SECONDS = 3600.0
_WAITABLE = (pb.SAVE_STATE_LOCAL, pb.SAVE_STATE_DURABLE)


@dataclass
class StepState:
    """One step of one job on this node, from first handoff to eviction."""

    job: str
    step: int
    state: int
    node_ranks: tuple[int, ...] = ()
    world_size: int = 1
    ranks: dict[int, tuple[RankRecord, list[ShardRecord], dict[str, Any]]] = field(
        default_factory=dict
    )
    writing: set[int] = field(default_factory=set)
    staging_dir: Path | None = None
    manifest: Manifest | None = None
    milestone: bool = False
    error: str = ""
    handoff_at: float = 0.0
    local_at: float = 0.0
    durable_at: float = 0.0
    remote_nodes: set[str] = field(default_factory=set)
    """Nodes whose ``_complete`` marker for this step is in the bucket."""
    metrics: dict[str, float] = field(default_factory=dict)
    created_unix: float = 0.0
    """When the checkpoint was committed (the time retention policies see)."""
    pinned: bool = False
    adopted: bool = False
    """An adopted directory tree (its remote layout differs: see layout.py)."""
    busy: int = 0
    """Operations reading a copy right now (a fetch from the bucket); no eviction meanwhile."""
    read_at: float = -1e18
    """time.monotonic() of the last Restore served from it."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def in_remote(self) -> bool:
        """A complete copy is in the remote tier."""
        return self.state == pb.SAVE_STATE_DURABLE or bool(self.remote_nodes)

    def reached(self, target: int) -> bool:
        """Has the save reached ``target`` (LOCAL or DURABLE)?"""
        if target == pb.SAVE_STATE_LOCAL:
            return self.manifest is not None or self.local_at > 0
        return self.in_remote

    def final(self, target: int) -> bool:
        """Will it never reach ``target``?"""
        if self.reached(target):
            return False
        if target == pb.SAVE_STATE_LOCAL:
            return self.state == pb.SAVE_STATE_FAILED
        return self.state in (pb.SAVE_STATE_FAILED, pb.SAVE_STATE_SUPERSEDED)

    def notify(self) -> None:
        """Wake every waiter; they re-check the state."""
        self.changed.set()
        self.changed = asyncio.Event()


class Node:
    """All state of one daemon. Create with :meth:`start`, stop with :meth:`close`."""

    def __init__(self, config: Config) -> None:
        self.config = config
        # Spare files: at most what the staging budget lets be in flight at once.
        self.store = LocalStore(config.root, config.staging_budget_bytes)
        self.staging = Staging(
            segment_prefix(config.root),
            config.staging_budget_bytes,
            config.lease_timeout_seconds,
        )
        self.steps: dict[tuple[str, int], StepState] = {}
        self.started_at = time.time()
        self._pool = ThreadPoolExecutor(max(2, 2 * config.write_workers), "ckptd-io")
        self._tasks: set[asyncio.Task[None]] = set()
        self.stopping = asyncio.Event()
        """Set on SIGTERM: waits for save states return at once."""
        self.on_local: list[Callable[[StepState], None]] = []
        """Called when a step commits locally (the drain and the evictor listen)."""
        self.pins_path = config.root / ".pins.json"

    async def start(self) -> None:
        """Recover the local tier and remove leftovers of a previous run."""
        recovery = await self.run_io(self.store.recover)
        removed_segments = self.staging.remove_leftovers()
        for m in recovery.manifests:
            self.steps[(m.job, m.step)] = StepState(
                m.job,
                m.step,
                pb.SAVE_STATE_LOCAL,
                manifest=m,
                milestone=m.milestone,
                node_ranks=tuple(r.rank for r in m.ranks),
                world_size=m.world_size,
                handoff_at=m.created_unix,
                local_at=m.created_unix,
                created_unix=m.created_unix,
                metrics=dict(m.metrics),
                adopted=m.adopted,
            )
        for job, step in await self.run_io(self._load_pins):
            st = self.steps.get((job, step))
            if st is not None:
                st.pinned = True
        for line in recovery.skipped:
            log.warning("ignoring step directory that is not a ckptd commit: %s", line)
        log.info(
            "recovered %d committed steps; removed %d staging leftovers and %d stale segments",
            len(recovery.manifests),
            recovery.removed_staging,
            removed_segments,
        )

    async def close(self) -> None:
        """Finish every acknowledged handoff, then release shared memory."""
        if self._tasks:
            log.info("finishing %d acknowledged saves before exit", len(self._tasks))
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.staging.close()
        self._pool.shutdown(wait=True)

    async def run_io(self, fn: Any, *args: Any) -> Any:
        """Run blocking file work on the daemon's I/O threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- leases --------------------------------------------------------------
    async def acquire_lease(self, job: str, size_bytes: int, wait_seconds: float = 0.0) -> Lease:
        """Grant shared memory for one rank's save, waiting up to ``wait_seconds`` for it."""
        return await self.staging.acquire(
            job, size_bytes, wait_seconds=min(max(wait_seconds, 0.0), MAX_WAIT_SECONDS)
        )

    def release_lease(self, lease_id: str) -> None:
        """Give back a lease the client will not commit."""
        if self.staging.get(lease_id).committed:
            raise Conflict(f"lease {lease_id!r} was committed; the daemon returns it when written")
        self.staging.release(lease_id)

    # -- save ----------------------------------------------------------------
    def commit(self, req: CommitRequest) -> int:
        """Take ownership of a lease's shards; the write runs in the background."""
        lease = self.staging.get(req.lease_id)
        if lease.job != req.job:
            raise InvalidArgument(
                f"lease {req.lease_id!r} was granted to job {lease.job!r}, not {req.job!r}"
            )
        if lease.committed:
            raise Conflict(f"lease {req.lease_id!r} was already committed; acquire a new lease")
        if lease.restore:
            raise InvalidArgument(
                f"lease {req.lease_id!r} holds restored data; acquire a save lease instead"
            )
        data_len = check_layout_or_raise(req.entries)
        if req.data_offset % ALIGN or req.data_offset + round_up(data_len) > lease.segment.size:
            raise InvalidArgument(
                f"shards span bytes {req.data_offset}..{req.data_offset + data_len} but lease "
                f"{req.lease_id!r} holds {lease.segment.size} bytes (data_offset must be a "
                f"multiple of {ALIGN}); acquire a lease large enough for the save"
            )
        st = self.steps.get((req.job, req.step))
        if st is not None and st.state == pb.SAVE_STATE_FAILED and not st.writing:
            st = None  # a failed save may be retried under the same step number
        if st is None:
            st = StepState(
                req.job,
                req.step,
                pb.SAVE_STATE_STAGING,
                node_ranks=req.node_ranks,
                world_size=req.world_size,
                handoff_at=time.time(),
            )
            st.staging_dir = self.store.new_staging_dir(req.job, req.step)
            self.steps[(req.job, req.step)] = st
        elif st.state != pb.SAVE_STATE_STAGING:
            raise Conflict(
                f"step {req.step} of job {req.job!r} already exists here ({state_name(st.state)}); "
                "save under a new step number"
            )
        elif st.node_ranks != req.node_ranks:
            raise InvalidArgument(
                f"rank {req.rank} names node ranks {list(req.node_ranks)} but step {req.step} was "
                f"started with {list(st.node_ranks)}; every rank must pass the same node_ranks"
            )
        if req.rank in st.ranks or req.rank in st.writing:
            raise Conflict(f"rank {req.rank} already committed step {req.step} of job {req.job!r}")
        self.staging.begin_commit(req.lease_id)
        st.writing.add(req.rank)
        st.milestone = st.milestone or req.milestone
        st.metrics.update(req.metrics)
        self.spawn(self._write_rank(st, req, lease, data_len))
        return st.state

    async def _write_rank(
        self, st: StepState, req: CommitRequest, lease: Lease, data_len: int
    ) -> None:
        name = rank_file_name(req.rank)
        assert st.staging_dir is not None
        try:
            header = build_header(
                req.entries,
                {
                    "format": "ckptd",
                    "dtypes": json.dumps(
                        {e.key: [req.dtype_names[e.key], list(e.shape)] for e in req.entries}
                    ),
                },
            )
            data = lease.segment.view(req.data_offset, round_up(data_len))
            ranges = [(e.offset, e.length) for e in req.entries]
            spare = self.store.take_spare(len(header) + data_len)
            _, (file_crc, crcs) = await asyncio.gather(
                self.run_io(
                    localstore.write_file_direct,
                    st.staging_dir / name,
                    header,
                    data,
                    data_len,
                    spare,
                ),
                self.run_io(localstore.crc32c_file_and_shards, header, data, data_len, ranges),
            )
            shards = [
                ShardRecord(
                    e.key,
                    req.rank,
                    req.dtype_names[e.key],
                    list(e.shape),
                    list(req.global_shapes[e.key]),
                    [list(s) for s in req.indexes[e.key]],
                    name,
                    len(header) + e.offset,
                    e.length,
                    crc,
                )
                for e, crc in zip(req.entries, crcs, strict=True)
            ]
            record = RankRecord(req.rank, name, len(header) + data_len, file_crc, req.tree)
            st.ranks[req.rank] = (record, shards, req.metadata)
        except Exception as exc:  # any failure fails the step, never the daemon
            log.exception("writing rank %d of %s/%d failed", req.rank, req.job, req.step)
            self._fail(st, f"writing rank {req.rank} failed: {exc}")
            return
        finally:
            st.writing.discard(req.rank)
            self.staging.release(req.lease_id)
        if st.state == pb.SAVE_STATE_STAGING and set(st.ranks) == set(st.node_ranks):
            await self._commit_step(st)

    async def _commit_step(self, st: StepState) -> None:
        ranks = [st.ranks[r] for r in sorted(st.ranks)]
        manifest = Manifest(
            job=st.job,
            step=st.step,
            node=self.config.node_id,
            world_size=st.world_size,
            created_unix=time.time(),
            ranks=[r for r, _, _ in ranks],
            shards=[s for _, shards, _ in ranks for s in shards],
            metadata=next((m for _, _, m in ranks if m), {}),
            milestone=st.milestone,
            metrics=dict(st.metrics),
        )
        assert st.staging_dir is not None
        try:
            await self.run_io(self.store.commit, st.staging_dir, manifest)
        except Exception as exc:
            log.exception("committing %s/%d failed", st.job, st.step)
            self._fail(st, f"local commit failed: {exc}")
            return
        st.ranks.clear()
        self.mark_local(st, manifest)
        log.info(
            "%s/%d LOCAL in %.3f s (%d bytes)",
            st.job,
            st.step,
            st.local_at - st.handoff_at,
            manifest.size_bytes,
        )

    def mark_local(self, st: StepState, manifest: Manifest) -> None:
        """A step just committed to the local tier (a save or an adoption): LOCAL, waiters
        woken, and the drain and the evictor told."""
        st.manifest, st.state, st.local_at, st.staging_dir = (
            manifest,
            pb.SAVE_STATE_LOCAL,
            time.time(),
            None,
        )
        st.created_unix = manifest.created_unix
        st.notify()
        for callback in self.on_local:
            callback(st)

    def _fail(self, st: StepState, reason: str) -> None:
        if st.state == pb.SAVE_STATE_FAILED:
            return
        st.state, st.error = pb.SAVE_STATE_FAILED, reason
        if st.staging_dir is not None:
            self.store.discard(st.staging_dir)
            st.staging_dir = None
        st.notify()

    # -- pins ----------------------------------------------------------------
    def _load_pins(self) -> list[tuple[str, int]]:
        try:
            raw = json.loads(self.pins_path.read_text())
            return [(str(job), int(step)) for job, steps in raw.items() for step in steps]
        except FileNotFoundError:
            return []
        except (ValueError, TypeError, AttributeError) as exc:
            log.error("ignoring unreadable %s: %s", self.pins_path, exc)
            return []

    async def save_pins(self) -> None:
        """Persist every pin (atomically: temp file, fsync, rename)."""
        pins: dict[str, list[int]] = {}
        for st in self.steps.values():
            if st.pinned:
                pins.setdefault(st.job, []).append(st.step)
        data = json.dumps({j: sorted(s) for j, s in sorted(pins.items())}).encode()
        await self.run_io(localstore.replace_synced, self.pins_path, data)

    # -- queries -------------------------------------------------------------
    def get_step(self, job: str, step: int) -> StepState:
        """The state of one step, or NotFound."""
        st = self.steps.get((job, step))
        if st is None:
            raise NotFound(
                f"no save of step {step} for job {job!r} on this node; `ckptd ls {job}` lists them"
            )
        return st

    async def wait(self, job: str, step: int, target: int, timeout: float) -> StepState:
        """Wait until a step reaches ``target``, fails, or ``timeout`` passes."""
        if target not in _WAITABLE:
            if target == pb.SAVE_STATE_UNSPECIFIED:
                return self.get_step(job, step)
            raise InvalidArgument(
                f"cannot wait for state {state_name(target)}; wait for LOCAL or DURABLE"
            )
        if target == pb.SAVE_STATE_DURABLE and not self.config.remote:
            raise FailedPrecondition(
                "this daemon has no remote tier configured, so no save becomes DURABLE; "
                "wait('local') instead"
            )
        deadline = time.monotonic() + min(max(timeout, 0.0), MAX_WAIT_SECONDS)
        while True:
            st = self.get_step(job, step)
            if st.reached(target) or st.final(target):
                return st
            left = deadline - time.monotonic()
            if left <= 0 or self.stopping.is_set():
                return st  # a stopping daemon answers waiters at once: the client asks again
            changed = asyncio.ensure_future(st.changed.wait())
            stopping = asyncio.ensure_future(self.stopping.wait())
            await asyncio.wait((changed, stopping), timeout=left, return_when="FIRST_COMPLETED")
            changed.cancel()
            stopping.cancel()

    def list(self, job: str = "") -> list[StepState]:
        """Steps of one job (or all), newest first within each job."""
        rows = [s for s in self.steps.values() if not job or s.job == job]
        return sorted(rows, key=lambda s: (s.job, -s.step))

    def spawn(self, coro: Any) -> None:
        """Run background work that :meth:`close` waits for."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def check_layout_or_raise(entries: list[TensorEntry]) -> int:
    """Validate a client's layout, converting ValueError to InvalidArgument."""
    try:
        return check_layout(entries)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
