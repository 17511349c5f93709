"""The composition root: every service of the daemon built once, wired, started, stopped.

Nothing else constructs a service or reaches into another's fields: the
services get what they need here, talk through the step catalog's transitions
and events, and run their background loops under the :class:`Supervisor`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from ckptd.core.redact import redact
from ckptd.proto import PROTOCOL_VERSION
from ckptd.proto import ckptd_pb2 as pb

from .. import __version__
from ..adopt.adopter import Adopter
from ..api.access import Access
from ..api.history import FILE_NAME as HISTORY_FILE
from ..api.history import JobHistory
from ..api.servicer import Services
from ..catalog import Catalog
from ..io import IoPool, set_nice
from ..lifecycle.drain import Drain
from ..lifecycle.evictor import Evictor
from ..lifecycle.pins import Pins
from ..local.admission import Admission, DiskSpace, Space, statvfs_space
from ..local.increment import Increments
from ..local.journal import Journal
from ..local.memory import MemoryTier
from ..local.prestaged import Prestaged
from ..local.room import Room
from ..local.saver import Saver
from ..local.segments import DIR_RECORD
from ..local.source import LocalSource
from ..local.staging import Staging, segment_prefix
from ..local.store import LocalStore
from ..remote.claim import NodeClaim, root_id
from ..remote.index import NodeIndex
from ..remote.node_fleet import NodeFleet
from ..remote.source import BucketSource
from ..restore.chooser import Chooser
from ..restore.restorer import Restorer
from ..restore.tier import Tier
from ..retention.planner import JobRetention, Retention
from .config import Config
from .metrics import Metrics, Sources, job_labels_shown
from .options import Options
from .peer_parts import build_peer_tier
from .startup import check_remote, open_remote_tier, recover, remote_error
from .supervisor import Supervisor

log = logging.getLogger("ckptd.server")


class Daemon:
    """All services of one ``ckptd serve``. :meth:`start`, then :meth:`stop`."""

    def __init__(
        self,
        config: Config,
        on_fatal: Callable[[str], None],
        measure_space: Callable[..., Space] = statvfs_space,
        options: Options | None = None,
    ) -> None:
        """Build every service, wired, in one phase: nothing here serves, starts a loop
        or is assigned onto a service later, so :meth:`status` and the metrics answer
        from the first request, while :meth:`start` still recovers. ``options``: the
        groups of ``config`` when the caller has already built them."""
        self.config = config
        opts = Options.of(config) if options is None else options
        self.started_at = time.time()
        self.supervisor = Supervisor(on_fatal)
        self.catalog = Catalog(opts.local.node_id)
        self._build_local(opts, measure_space)
        self._build_remote(opts)
        self._build_restore(opts)
        self._build_lifecycle(opts)
        self._build_metrics(opts)

    def _build_local(self, opts: Options, measure_space: Callable[..., Space]) -> None:
        """The local tier: I/O threads, disk, staging and the memory tier, journal, saver."""
        local = opts.local
        set_nice(local.io_nice)  # before the I/O and checksum threads start
        self.io = IoPool(2 * local.write_workers)
        # Evictions get threads of their own: behind a queue of rank-file writes they
        # fell behind a sustained save rate and the disk filled (bench/soak).
        self.evict_io = IoPool(2)
        # Spare files: at most what the staging budget lets be in flight at once.
        self.store = LocalStore(local.root, local.staging_budget_bytes)
        owners: dict[str, int] = {}  # one table: Access fills it, staging reads it
        room = Room()  # staging asks it for room, the memory tier answers (local/room.py)
        self.staging = Staging(
            segment_prefix(local.root),
            local.staging_budget_bytes,
            local.lease_timeout_seconds,
            uid_of=owners.get,
            share_per_uid=local.staging_share_per_uid,
            record=local.root / DIR_RECORD,
            room=room,
        )
        self.access = Access(local.root, self.staging, opts.api.sharing, owners)
        self.memory = MemoryTier(
            self.staging, self.catalog, local.memory_tier_steps, local.memory_tier_bytes,
            self.supervisor.spawn, room,
        )  # fmt: skip
        self.journal = Journal(local.root)
        self.history = JobHistory(local.root / HISTORY_FILE, nodes=self._node_totals)
        self.saver = Saver(
            self.catalog,
            self.staging,
            self.store,
            self.io,
            local.node_id,
            self.supervisor.spawn,
            self.journal,
            local.step_timeout_seconds,
            self.memory,
            Increments(
                local.incremental, local.incremental_max_files, local.incremental_full_every
            ),
            local.supersede_unwritten,
        )
        self.disk = DiskSpace(
            local.root, local.local_low_watermark, local.local_floor, measure_space
        )

    def _build_remote(self, opts: Options) -> None:
        """The bucket tier and what each tier keeps: retention, the node index and
        claim, the evictor and admission."""
        local, lifecycle = opts.local, opts.lifecycle
        self.remote = open_remote_tier(opts.remote)
        self.retention = Retention(
            self.catalog,
            lifecycle.retention_local,
            lifecycle.retention_remote if self.remote is not None else None,
            evict_unuploaded=lifecycle.local_evict_unuploaded,
            jobs=JobRetention.of(local.root, lifecycle, self.remote, local.node_id),
        )
        # This node's step index in the bucket (remote/index.py): one owner, shared by
        # the drain (adds), the evictor (removes), pins and restores (reads).
        self.index = (
            NodeIndex(
                self.remote,
                local.node_id,
                opts.remote.remote_read_jitter_seconds,
                owner_of=self.access.owner_of,
                owner_found=self.access.found_in_bucket,
            )
            if self.remote is not None
            else None
        )
        # The node name's claim in the bucket (remote/claim.py): without it the daemon
        # saves locally but writes nothing there.
        claim = self.claim = (
            NodeClaim(
                self.remote,
                local.node_id,
                root_id(local.root),
                opts.remote.node_claim_heartbeat_seconds,
                opts.remote.node_claim_stale_seconds,
                opts.remote.node_claim_takeover,
            )
            if self.remote is not None
            else None
        )
        # The node names' claims, sampled: the node-loss rate Goodput() learns (JobHistory).
        self.node_fleet = NodeFleet(claim.remote, claim) if claim is not None else None
        self.evictor = Evictor(
            self.catalog,
            self.retention,
            self.store,
            self.disk,
            self.evict_io,
            self.remote,
            self.index,
            may_write_remote=(lambda: claim.held) if claim is not None else lambda: True,
        )
        self.admission = Admission(
            self.disk,
            self.staging,
            self.store,
            self.io.run,
            lifecycle.retention_local.describe(),
            relieve=self.evictor.relieve_local,
        )

    def _build_restore(self, opts: Options) -> None:
        """The restore's tiers, fastest first (each answers restore/tier.py's
        interface), and the restorer over them."""
        prestaged = Prestaged(self.staging, self.catalog)
        local_tier = LocalSource(self.catalog, self.store, self.staging, self.io)
        self.bucket = BucketSource(
            self.catalog, self.store, prestaged, self.io, self.remote, self.index
        )
        owners = (self.access.owner_of, self.access.found_on_peer)
        learn = self.bucket.refresh_quietly
        self.peer = (
            build_peer_tier(opts.peer, self.catalog, self.store, self.io, prestaged, owners, learn)
            if opts.peer.enabled
            else None
        )
        peer = self.peer.source if self.peer is not None else None
        tiers: list[Tier] = [
            self.memory,
            prestaged,
            local_tier,
            *([peer] if peer else []),
            self.bucket,
        ]
        self.restorer = Restorer(
            self.catalog,
            self.store,
            self.staging,
            Chooser(self.catalog, tiers, local_tier),
            local_tier,
            self.bucket,
            self.saver.newest_written,
        )

    def _build_lifecycle(self, opts: Options) -> None:
        """What acts on steps after LOCAL: adoption, pins, the drain."""
        local, lifecycle = opts.local, opts.lifecycle
        self.adopter = Adopter(
            self.catalog,
            self.store,
            self.io,
            self.restorer,
            self.bucket,
            lifecycle.adopt_poll_seconds,
            lifecycle.adopt_dirs,
        )
        self.pins = Pins(self.catalog, local.root, self.io, self.remote, self.index)
        self.drain = (
            Drain(
                self.catalog,
                self.remote,
                self.index,
                self.store,
                self.io,
                self.retention,
                lifecycle.drain_retry_max_seconds,
                lifecycle.drain_stall_seconds,
                self.claim,
            )
            if self.remote is not None and self.index is not None
            else None
        )

    def _build_metrics(self, opts: Options) -> None:
        """The metrics, fed by catalog events and read at scrape."""
        self.started = False
        self.metrics_address = ""
        """Where /metrics is served (:meth:`serves_metrics`); empty when it is not."""
        self.metrics = Metrics(
            Sources(
                self.catalog,
                self.status,
                self.drain.lag if self.drain is not None else lambda: 0.0,
                self.remote is not None,
                self._ready,
                self.access.live.jobs,
                lambda: job_labels_shown(
                    opts.metrics.metrics_job_labels,
                    {*self.access.owners.values(), *self.access.live.uids()},
                    opts.api.sharing.any,
                ),
            )
        )
        self.catalog.subscribe(lambda event: self.metrics.on_event(event, self.catalog))

    def _ready(self) -> bool:
        return self.started

    def _node_totals(self) -> tuple[float, int, int]:
        """The node names' record for JobHistory: (observed seconds, replacements,
        names)."""
        return self.node_fleet.totals() if self.node_fleet is not None else (0.0, 0, 0)

    def process_gone(self, process: tuple[int, int]) -> None:
        """A client process exited (sessions.py): its uncommitted leases come back, and
        the memory tier checks what it wrote, ahead of its restart."""
        self.access.process_gone(process)
        self.memory.writer_gone(process)

    def unhealthy(self) -> str:
        """Why the daemon is not healthy (a background service gave up); empty if it is."""
        failed = [h.name for h in self.supervisor.health.values() if h.state == "failed"]
        return f"background services failed: {', '.join(failed)}" if failed else ""

    async def start(self) -> None:
        """Recover the local tier and replay the journal, check the remote tier, claim
        the node name, then start every loop (the services exist since construction)."""
        await recover(
            self.config.root,
            self.catalog,
            self.store,
            self.staging,
            self.journal,
            self.saver,
            self.access,
            self.io,
            self.memory,
        )
        await check_remote(self.remote, self.config.remote)
        await self.adopter.load()
        if self.claim is not None:  # before the drain; its loop renews it (or tries again)
            await self.claim.try_acquire(30)
            self.supervisor.service("claim", self.claim.run)
        if self.node_fleet is not None:  # in the background: it only tunes an interval
            self.supervisor.service("node-fleet", self.node_fleet.run)
        await self.retention.jobs.settle_all(self.catalog.jobs())  # jobs' own, read first
        if self.drain is not None:
            # With a jitter the node's index is read in the background (the drain's
            # first act): local restores need nothing from the bucket, so a restarting
            # job does not wait for it.
            if not self.config.remote_read_jitter_seconds:
                try:
                    await asyncio.wait_for(self.drain.resume(), 120)
                except Exception as exc:
                    raise remote_error(self.config.remote, exc) from None
            self.supervisor.service("drain", self.drain.run)
        self.evictor.kick()  # apply the retention to what recovery found
        self.supervisor.service("evictor", self.evictor.run)
        self.supervisor.service("adopter", self.adopter.run)
        if self.peer is not None:
            await self.peer.start(self.supervisor.service, self.supervisor.spawn)
        self.started = True

    def services(self) -> Services:
        """What the wire API calls."""
        return Services(
            catalog=self.catalog,
            saver=self.saver,
            staging=self.staging,
            admission=self.admission,
            retention=self.retention,
            restorer=self.restorer,
            adopter=self.adopter,
            pins=self.pins,
            access=self.access,
            remote_url=self.remote.url if self.remote is not None else "",
            status=self.status,
            restored=self.metrics.restored,
            history=self.history,
            paced=self.drain.pace.ask if self.drain is not None else lambda job, seconds: None,
            evict=self.evictor.kick,
        )

    def serves_metrics(self, address: str) -> None:
        """``serve`` bound the metrics endpoint at ``address`` (told in status)."""
        self.metrics_address = address

    def begin_stop(self) -> None:
        """Stop begins: waiters answer at once (clients ask the next daemon), and no
        shared memory is made from now on (the saves being finished use the pool's)."""
        self.catalog.stopping.set()
        self.staging.begin_stop()

    async def stop(self) -> None:
        """Stop the loops, finish every acknowledged save, release shared memory."""
        self.begin_stop()
        self.evictor.stop()
        self.adopter.stop()
        if self.drain is not None:
            self.drain.stop()
        if self.peer is not None:
            self.peer.halt()
        if self.claim is not None:
            self.claim.stop()
        if self.node_fleet is not None:
            self.node_fleet.stop()
        await self.supervisor.stop_services()
        if self.peer is not None:
            await self.peer.stop()
        if self.claim is not None:
            await self.claim.release()
        if self.remote is not None:
            await self.remote.close()
        if self.supervisor.jobs_running:
            log.info("finishing %d acknowledged saves before exit", self.supervisor.jobs_running)
        await self.supervisor.finish_jobs()
        self.history.close()
        self.memory.close()
        self.staging.close()
        self.journal.close()
        self.evict_io.close()
        self.io.close()

    def status(self) -> pb.DaemonStatus:
        """Health, configuration summary and resource use (``ckptd status``)."""
        cfg, staging, steps = self.config, self.staging, self.catalog.steps()
        space = self.disk.space()
        low, floor = self.disk.marks(space)
        manifests = [s.manifest for s in steps if s.manifest is not None]
        return pb.DaemonStatus(
            version=__version__,
            protocol_version=PROTOCOL_VERSION,
            node_id=cfg.node_id,
            root=str(cfg.root),
            socket=str(cfg.socket),
            remote=redact(cfg.remote),
            drain_queue=self.drain.queue_length if self.drain else 0,
            drain_error=redact(self.drain.last_error) if self.drain else "",
            uptime_seconds=time.time() - self.started_at,
            staging_budget_bytes=staging.budget_bytes,
            staging_allocated_bytes=staging.allocated_bytes,
            staging_in_use_bytes=staging.in_use_bytes,
            staging_segments_created=staging.segments_created,
            staging_spares_made=staging.spares.made,
            leases_held=staging.leases_held,
            saves_in_flight=self.catalog.count(pb.SAVE_STATE_STAGING),
            local_free_bytes=space.free,
            local_used_bytes=sum(m.size_bytes for m in manifests),
            jobs=len(self.catalog.jobs()),
            checkpoints=len(manifests),
            pid=os.getpid(),
            retention_local=self.retention.local_policy.describe(),
            retention_remote=(
                self.retention.remote_policy.describe() if self.retention.remote_policy else ""
            ),
            local_low_watermark_bytes=low,
            local_floor_bytes=floor,
            evicted_local=self.evictor.evicted_local,
            evicted_remote=self.evictor.evicted_remote
            + (self.drain.replaced.finished if self.drain else 0),
            watched_directories=len(self.adopter.watches),
            adopted=self.adopter.adopted,
            tasks=[
                pb.TaskHealth(
                    name=h.name,
                    state=h.state,
                    restarts=h.restarts,
                    last_error=redact(h.last_error),
                )
                for h in self.supervisor.health.values()
            ],
            job_errors=self.supervisor.job_errors,
            last_event_seq=self.catalog.last_seq,
            metrics_address=self.metrics_address,
            remote_endpoint_url=redact(cfg.remote_endpoint_url or ""),
            fetch_in_flight_bytes=self.bucket.in_flight_bytes,
            fetch_done_bytes=self.bucket.in_flight_done,
            **(self.peer.status() if self.peer is not None else {}),
            **self.memory.status(),
        )
