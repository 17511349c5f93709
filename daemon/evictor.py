"""The evictor: applies the retention plans (evict_plan.py) to the tiers.

It runs after every local commit, every upload, every pin change and every
30 s (time-based policies, free space). Local copies are renamed into
``<root>/.trash`` (their commit point in reverse: gone from view at once) and
then deleted; a remote copy loses its ``_complete`` marker before its objects,
so a half-deleted step is never listed. Below the low watermark it also removes
local copies the bucket holds, oldest first, until the mark is met; saves that
would take the disk below the floor are refused (see :meth:`check_space`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass

from ckptd.proto import ckptd_pb2 as pb

from .config import parse_space
from .errors import ResourceExhausted
from .evict_plan import Plan, StepView, plan_job
from .layout import marker_key, record_prefix, step_prefix
from .node import Node, StepState
from .remote import Remote
from .retention import Policy, parse_policy

log = logging.getLogger("ckptd.evictor")

PERIOD_SECONDS = 30.0
READ_GRACE_SECONDS = 120.0
"""A step served by Restore is not evicted for this long: the client may still open it."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass
class Space:
    """Free space of the local tier's filesystem, in bytes."""

    free: int
    total: int


class Evictor:
    """One per daemon; ``remote`` is None without a remote tier."""

    def __init__(self, node: Node, remote: Remote | None) -> None:
        cfg = node.config
        self.node = node
        self.remote = remote
        self.local_policy: Policy = parse_policy(cfg.retention_local)
        self.remote_policy: Policy | None = (
            parse_policy(cfg.retention_remote) if remote is not None else None
        )
        self.evicted_local = 0
        self.evicted_remote = 0
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._lock = asyncio.Lock()
        node.on_local.append(lambda _st: self.kick())

    # -- views and plans -------------------------------------------------------------
    def space(self) -> Space:
        """Free and total bytes of the local tier's filesystem."""
        st = os.statvfs(self.node.config.root)
        return Space(st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)

    def marks(self, space: Space | None = None) -> tuple[int, int]:
        """(low watermark, floor) in bytes."""
        total = (space or self.space()).total
        cfg = self.node.config
        return parse_space(cfg.local_low_watermark, total), parse_space(cfg.local_floor, total)

    def _view(self, st: StepState, now: float) -> StepView:
        node_id = self.node.config.node_id
        return StepView(
            step=st.step,
            time=st.created_unix or st.handoff_at,
            milestone=st.milestone,
            metrics=st.metrics,
            pinned=st.pinned,
            local=st.manifest is not None,
            remote=node_id in st.remote_nodes,
            pending=st.state in (pb.SAVE_STATE_LOCAL, pb.SAVE_STATE_DRAINING),
            busy=st.busy > 0
            or st.state == pb.SAVE_STATE_DRAINING
            or now - st.read_at < READ_GRACE_SECONDS,
        )

    def plan(self, job: str) -> Plan:
        """The current plan for one job (also used by the drain and ``ckptd ls``)."""
        now, mono = time.time(), time.monotonic()
        views = [self._view(s, mono) for s in self.node.steps.values() if s.job == job]
        return plan_job(
            views,
            self.local_policy,
            self.remote_policy,
            now,
            evict_unuploaded=self.node.config.local_evict_unuploaded,
        )

    def remote_wants(self, job: str) -> set[int]:
        """Pending steps of ``job`` the bucket will keep (the drain uploads those)."""
        return self.plan(job).remote_wants

    def mark_superseded(self, job: str) -> None:
        """Pending steps the bucket will never want become SUPERSEDED (called on DURABLE)."""
        supersede = self.plan(job).supersede
        if not supersede:
            return
        node_id = self.node.config.node_id
        newest = max(
            s.step for s in self.node.steps.values() if s.job == job and node_id in s.remote_nodes
        )
        for step in supersede:
            st = self.node.steps.get((job, step))
            if st is not None and st.state == pb.SAVE_STATE_LOCAL:
                st.state = pb.SAVE_STATE_SUPERSEDED
                st.error = (
                    f"superseded by step {newest}, uploaded first (coalescing drain); "
                    "the remote retention does not keep this step"
                )
                st.notify()

    # -- running ------------------------------------------------------------------------
    def kick(self) -> None:
        """Ask for a pass soon."""
        self._wake.set()

    def stop(self) -> None:
        """Stop after the current pass."""
        self._stop.set()
        self._wake.set()

    async def run(self) -> None:
        """Pass after every kick, and every PERIOD_SECONDS."""
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), PERIOD_SECONDS)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                await self.run_once()
            except Exception:  # a failed pass is retried on the next one
                log.exception("eviction pass failed")

    async def run_once(self) -> None:
        """One pass: every job's plan, then the low watermark."""
        async with self._lock:
            for job in sorted({s.job for s in self.node.steps.values()}):
                self.mark_superseded(job)
                plan = self.plan(job)
                for step in plan.evict_remote:
                    await self._evict_remote(job, step, "retention")
                for step in plan.evict_local:
                    await self._evict_local(job, step, "retention")
            await self._relieve_pressure()

    async def _relieve_pressure(self) -> None:
        space = self.space()
        low, _ = self.marks(space)
        if space.free >= low:
            return
        if await self.node.run_io(self.node.store.drop_spares) and self.space().free >= low:
            return  # spare files were enough
        candidates: list[tuple[float, str, int]] = []
        for job in {s.job for s in self.node.steps.values()}:
            for step in self.plan(job).pressure:
                st = self.node.steps[(job, step)]
                candidates.append((st.created_unix or st.handoff_at, job, step))
        for _, job, step in sorted(candidates):
            if self.space().free >= low:
                break
            await self._evict_local(job, step, f"free space below the low watermark {_gib(low)}")

    async def _evict_local(self, job: str, step: int, why: str) -> None:
        st = self.node.steps.get((job, step))
        if st is None or st.manifest is None:
            return
        if st.busy or time.monotonic() - st.read_at < READ_GRACE_SECONDS:
            return  # a restore chose it after the plan was made
        await self.node.run_io(self.node.store.evict, job, step)
        self.evicted_local += 1
        st.manifest = None
        if not st.in_remote:
            self.node.steps.pop((job, step), None)
        log.info("evicted %s/%d from the local tier (%s)", job, step, why)
        st.notify()

    async def _evict_remote(self, job: str, step: int, why: str) -> None:
        st = self.node.steps.get((job, step))
        assert self.remote is not None
        if st is None:
            return
        node_id = self.node.config.node_id
        try:
            # The marker first: from then on the step is not complete, never listed.
            await self.remote.delete([marker_key(job, step, node_id, st.adopted)])
            st.remote_nodes.discard(node_id)
            tree, records = step_prefix(job, step), record_prefix(job, step, st.adopted)
            prefixes = [f"{records}/{node_id}/"]
            if st.adopted:  # out of the framework's view first, then deleted
                await self.remote.retract_tree(tree, records, node_id)
                prefixes.append(f"{tree}/")
            for prefix in prefixes:
                await self.remote.delete(await self.remote.list_keys(prefix))
        except Exception as exc:
            log.warning("could not remove %s/%d from %s: %s", job, step, self.remote.url, exc)
            return
        self.evicted_remote += 1
        log.info("evicted %s/%d from the remote tier (%s)", job, step, why)
        if st.manifest is None and not st.remote_nodes:
            self.node.steps.pop((job, step), None)
        elif st.manifest is not None and st.state == pb.SAVE_STATE_DURABLE:
            st.state = pb.SAVE_STATE_SUPERSEDED
            st.error = "removed from the remote tier by its retention policy"
        st.notify()

    # -- admission ---------------------------------------------------------------------
    async def check_space(self, size_bytes: int, wait: bool = True) -> None:
        """Refuse a save that would take the local disk below the floor.

        Counts the bytes of saves still being written. If the floor would be
        crossed, runs one eviction pass first (``wait``) and checks again.
        """
        for attempt in (0, 1):
            space, floor, writing, need = self._disk_need(size_bytes)
            if space.free >= need:
                return
            if attempt == 0 and wait:
                await self.node.run_io(self.node.store.drop_spares)
                await self.run_once()
        raise ResourceExhausted(
            f"local tier {self.node.config.root} has {_gib(space.free)} free; this save "
            f"needs {_gib(size_bytes)} plus {_gib(writing)} for saves being written, and "
            f"{_gib(floor)} must stay free (local_floor = {self.node.config.local_floor!r}): "
            f"{_gib(need - space.free)} short. Free disk space, keep fewer checkpoints "
            f"(retention_local = {self.local_policy.describe()!r}) or lower local_floor"
        )

    def capacity_reason(self, size_bytes: int) -> str:
        """Why a save of ``size_bytes`` could not start right now ("" if it could)."""
        staging = self.node.staging
        if not staging.could_grant(size_bytes):
            return (
                f"staging memory is held by in-flight saves ({staging.in_use_bytes} of "
                f"{staging.budget_bytes} bytes)"
            )
        space, floor, _, need = self._disk_need(size_bytes)
        if space.free < need:
            return f"local disk has {_gib(space.free)} free; the floor is {_gib(floor)}"
        return ""

    def _disk_need(self, size_bytes: int) -> tuple[Space, int, int, int]:
        """(space, floor, bytes of saves still being written, free bytes a save needs)."""
        space = self.space()
        _, floor = self.marks(space)
        writing = self.node.staging.committed_bytes
        return space, floor, writing, size_bytes + writing + floor
