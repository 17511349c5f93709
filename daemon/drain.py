"""The drain: uploads LOCAL steps to the remote tier in the background.

Newest first and coalescing: when the uploader is free it takes each job's
newest LOCAL step; an older pending step goes up only if the remote retention
would keep it (``wants``, from the evictor), otherwise it becomes SUPERSEDED
once a newer step is DURABLE. Each step's objects are uploaded in parallel
parts and verified against the crc32c recorded at local commit; the
``_complete/<node>`` marker goes last. Transient errors are retried with
exponential backoff and full jitter; a permanent one marks the step FAILED
(its local copy stays restorable). At start-up, steps whose marker is already
in the bucket are DURABLE and the others are queued again; files already in
the bucket with the right crc32c are not sent twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Callable

from ckptd.proto import ckptd_pb2 as pb

from . import faults
from .layout import (
    complete_steps_in,
    file_key,
    manifest_key,
    marker_key,
    parse_pin,
    record_prefix,
    step_prefix,
    tree_path,
    upload_order,
)
from .node import Node, StepState
from .remote import Remote, is_transient
from .restore import verify_step

log = logging.getLogger("ckptd.drain")


class Backoff:
    """Exponential backoff with full jitter; ``rand`` is injectable for tests."""

    def __init__(
        self, initial: float, maximum: float, rand: Callable[[], float] = random.random
    ) -> None:
        self.initial, self.maximum, self.rand = initial, maximum, rand

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        return float(self.rand() * min(self.maximum, self.initial * 2**attempt))


class Drain:
    """One background uploader per daemon."""

    def __init__(self, node: Node, remote: Remote, retry_max_seconds: float) -> None:
        self.node = node
        self.remote = remote
        self.backoff = Backoff(0.5, retry_max_seconds)
        self.last_error = ""
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        node.on_local.append(lambda _st: self._wake.set())
        self.wants: Callable[[str], set[int]] = lambda job: set()
        """Older pending steps of a job the remote retention keeps; the evictor sets this
        to its plan (until then only each job's newest step is uploaded)."""
        self.on_durable: list[Callable[[StepState], None]] = []

    @property
    def queue_length(self) -> int:
        """Steps waiting to be uploaded (or being uploaded)."""
        return sum(1 for s in self.node.steps.values() if s.state in _PENDING)

    async def resume(self) -> None:
        """Match the local index against the bucket's markers (start-up)."""
        keys = await self.remote.list_keys("")
        markers = complete_steps_in(keys)
        pins = {pin for pin in map(parse_pin, keys) if pin is not None}
        node_id = self.node.config.node_id
        remote_only = []
        for (job, step), found in markers.items():
            st = self.node.steps.get((job, step))
            if st is None:
                st = StepState(job, step, pb.SAVE_STATE_DURABLE)
                self.node.steps[(job, step)] = st
            st.remote_nodes |= found.nodes
            st.pinned = st.pinned or (job, step) in pins
            st.adopted = st.adopted or found.adopted
            if st.manifest is not None and node_id in found.nodes:
                st.state = pb.SAVE_STATE_DURABLE
            elif st.manifest is None and node_id in found.nodes:
                remote_only.append(st)
        # Retention needs the time, milestone flag and metrics of steps that are
        # only in the bucket: our markers carry them.
        limit = asyncio.Semaphore(16)

        async def learn(st: StepState) -> None:
            async with limit:
                with contextlib.suppress(Exception):
                    raw = await self.remote.get_bytes(
                        marker_key(st.job, st.step, node_id, st.adopted)
                    )
                    info = json.loads(raw)
                    st.created_unix = float(info.get("created_unix") or info.get("time") or 0)
                    st.milestone = bool(info.get("milestone", False))
                    st.metrics = {str(k): float(v) for k, v in (info.get("metrics") or {}).items()}

        await asyncio.gather(*(learn(st) for st in remote_only))
        await self.remote.cleanup_incomplete("")
        log.info(
            "remote %s: %d complete steps; %d local steps to upload",
            self.remote.url,
            len(markers),
            self.queue_length,
        )

    def stop(self) -> None:
        """Ask the loop to stop after the current attempt (the step is retried next start)."""
        self._stop.set()
        self._wake.set()

    async def run(self) -> None:
        """Upload until stopped."""
        while not self._stop.is_set():
            st = self.pick()
            if st is None:
                self._wake.clear()
                if self.pick() is None:
                    await self._wake.wait()
                continue
            await self._drain(st)

    def pick(self) -> StepState | None:
        """Each job's newest pending step first (most recently committed job first), then
        older steps the remote retention keeps, newest first."""
        by_job: dict[str, list[StepState]] = {}
        for s in self.node.steps.values():
            if s.state == pb.SAVE_STATE_LOCAL and s.manifest is not None:
                by_job.setdefault(s.job, []).append(s)
        newest = [max(steps, key=lambda s: s.step) for steps in by_job.values()]
        fresh = [s for s in newest if not self._newer_in_remote(s)]
        if fresh:
            return max(fresh, key=lambda s: s.local_at)
        older = [s for job, steps in by_job.items() for s in steps if s.step in self.wants(job)]
        return max(older, key=lambda s: s.step) if older else None

    def _newer_in_remote(self, st: StepState) -> bool:
        node_id = self.node.config.node_id
        return any(
            s.job == st.job and s.step > st.step and node_id in s.remote_nodes
            for s in self.node.steps.values()
        )

    async def _drain(self, st: StepState) -> None:
        st.state, st.error = pb.SAVE_STATE_DRAINING, ""
        st.notify()
        attempt = 0
        while True:
            try:
                await self._upload(st)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._stop.is_set():
                    st.state = pb.SAVE_STATE_LOCAL
                    return
                reason = f"upload to {self.remote.url} failed: {exc}"
                changed = await self._adopted_changed(st) if attempt >= 2 else ""
                if changed:
                    reason = changed
                if changed or not is_transient(exc):
                    log.error("%s/%d: %s (not retrying)", st.job, st.step, reason)
                    st.state, st.error, self.last_error = pb.SAVE_STATE_FAILED, reason, reason
                    st.notify()
                    return
                delay = self.backoff.delay(attempt)
                attempt += 1
                st.error = self.last_error = f"retrying in {delay:.1f} s: {reason}"
                log.warning("%s/%d: %s", st.job, st.step, st.error)
                if self._newer_pending(st) and st.step not in self.wants(st.job):
                    st.state = pb.SAVE_STATE_LOCAL  # coalesce: the newer step goes first
                    st.notify()
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
        st.state, st.error, self.last_error = pb.SAVE_STATE_DURABLE, "", ""
        st.durable_at = time.time()
        st.remote_nodes.add(self.node.config.node_id)
        log.info(
            "%s/%d DURABLE in %.3f s after handoff", st.job, st.step, st.durable_at - st.handoff_at
        )
        st.notify()
        for callback in self.on_durable:
            callback(st)

    async def _adopted_changed(self, st: StepState) -> str:
        """Why an adopted step can never upload, if its files changed since adoption
        (they are hard links to the framework's files); empty otherwise."""
        if not st.adopted or st.manifest is None:
            return ""
        local_dir = self.node.store.step_dir(st.job, st.step)
        bad = await self.node.run_io(verify_step, local_dir, st.manifest)
        if not bad:
            return ""
        return (
            f"{len(bad)} adopted files changed after adoption (e.g. {bad[0]}): ckptd holds hard "
            "links to them, so a directory must not be modified once adopted; adopt the new "
            "version under a new step"
        )

    def _newer_pending(self, st: StepState) -> bool:
        return any(
            s.job == st.job and s.step > st.step and s.state == pb.SAVE_STATE_LOCAL
            for s in self.node.steps.values()
        )

    async def _upload(self, st: StepState) -> None:
        manifest = st.manifest
        assert manifest is not None
        node_id = self.node.config.node_id
        local_dir = self.node.store.step_dir(st.job, st.step)
        adopted = manifest.adopted
        # An adopted tree goes where its framework reads it; on file:// it is written
        # under ckptd's records first and renamed into place whole (Orbax treats any
        # local directory without a tmp suffix as finished).
        tree = step_prefix(st.job, st.step)
        staging = self.remote.tree_staging(tree, record_prefix(st.job, st.step, True), node_id)

        async def one(rank_file: str, size: int, crc32c: int) -> None:
            key = (
                f"{staging}/{tree_path(rank_file)}"
                if adopted
                else file_key(st.job, st.step, node_id, rank_file)
            )
            with contextlib.suppress(FileNotFoundError):
                if await self.remote.native_crc32c(key) == crc32c:
                    log.info(
                        "%s is already in the bucket with the right crc32c: not sent again", key
                    )
                    return
            await self.remote.put_file(local_dir / rank_file, key, size, crc32c)

        records = {r.file: r for r in manifest.ranks}
        # Adopted trees go in waves so that Orbax's commit_success.txt lands last.
        waves = upload_order(list(records)) if adopted else [list(records)]
        for i, wave in enumerate(waves):
            if adopted and i == len(waves) - 1:
                await asyncio.to_thread(faults.hit, "drain.before_tree_commit")
            await asyncio.gather(*(one(f, records[f].size, records[f].crc32c) for f in wave))
        if adopted:
            await self.remote.publish_tree(staging, tree)
        manifest_bytes = await self.node.run_io((local_dir / "manifest.json").read_bytes)
        await self.remote.put_bytes(manifest_key(st.job, st.step, node_id, adopted), manifest_bytes)
        await asyncio.to_thread(faults.hit, "drain.before_marker")
        marker = {
            "node": node_id,
            "job": st.job,
            "step": st.step,
            "time": time.time(),
            "files": [r.file for r in manifest.ranks] + ["manifest.json"],
            # What retention needs once the local copy is gone.
            "created_unix": manifest.created_unix,
            "milestone": st.milestone,
            "metrics": st.metrics,
        }
        await self.remote.put_bytes(
            marker_key(st.job, st.step, node_id, adopted), json.dumps(marker).encode()
        )
        # Attempts cut by an outage could not abort their multipart uploads: do it now.
        with contextlib.suppress(Exception):
            await self.remote.cleanup_incomplete(f"{tree}/" if adopted else f"{tree}/{node_id}/")


_PENDING = (pb.SAVE_STATE_LOCAL, pb.SAVE_STATE_DRAINING)
