"""Prometheus metrics of one daemon (``ckptd_`` prefix, base units).

Two kinds, both in a registry of this daemon's own (never the process-global one):

- counters and histograms fed by the step catalog's events (the listener runs on
  the loop at every transition and only adds numbers): saves by result, bytes by
  stage, handoff->LOCAL and handoff->DURABLE latency, evictions, errors by stage,
  restores by tier;
- gauges read from the services when scraped: ``ckptd_exposure_seconds{job,tier}``
  (now minus the newest complete step's time in that tier: the work a failure now
  would cost), drain queue and lag, tier occupancy, free space, staging memory,
  saves in flight, background task restarts.

Exposure is reported only for running jobs: a save in flight, or a live process
that saved or adopted the job (api/liveness.py). A job that ended has nothing left
to lose, and its newest checkpoint only ages: its series leaves the scrape, so an
alert on it resolves instead of firing after every job.

``/metrics`` answers anyone who reaches the port, and job names say what users
train. ``metrics_job_labels`` decides whether series carry them: ``on``, ``off``
(one series per tier, the worst running job's exposure), or ``auto`` (default): on
while a single user saves on this node, off once jobs of several uids are recorded
or ``allow_uids``, ``allow_gids`` or ``shared_jobs`` let several users share jobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ckptd.proto import ckptd_pb2 as pb

from .. import __version__
from ..catalog import Event
from ..catalog.roles import Steps

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
"""Seconds: a 64 MiB save reaches LOCAL in ~0.05 s; a large drain takes many minutes."""

_RESULTS: dict[int, str] = {
    pb.STEP_EVENT_LOCAL: "local",
    pb.STEP_EVENT_DURABLE: "durable",
    pb.STEP_EVENT_FAILED: "failed",
    pb.STEP_EVENT_ABANDONED: "abandoned",
}


@dataclass
class Sources:
    """What the scrape-time gauges read (the composition root fills it in)."""

    catalog: Steps
    status: Callable[[], pb.DaemonStatus]
    """The daemon's ``GetStatus`` answer: drain queue, staging, free space, tasks."""
    drain_lag: Callable[[], float]
    """Seconds the oldest LOCAL step not yet in the bucket has waited (0: none)."""
    remote: bool
    started: Callable[[], bool]
    """False while the daemon recovers at start-up: only counters are shown then."""
    live_jobs: Callable[[], Collection[str]] = frozenset
    """Jobs a live process is saving (api/liveness.py): exposure is theirs only."""
    job_labels: Callable[[], bool] = lambda: True
    """Whether series may carry job names (see :func:`job_labels_shown`)."""


class Metrics:
    """The daemon's registry; :meth:`on_event` is subscribed to the catalog."""

    def __init__(self, sources: Sources, clock: Callable[[], float] = time.time) -> None:
        # No "_created" series beside every counter: dashboards never use them, and
        # they double the scrape (the daemon owns its process, so the switch is ours).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        self._clock = clock
        r = self.registry
        self.saves = Counter(
            "ckptd_saves",
            "Saves by result: local, durable, failed, abandoned, superseded (a newer "
            "save of the job was written in its place before its write began).",
            ["result"],
            registry=r,
        )
        self.bytes = Counter(
            "ckptd_bytes",
            "Checkpoint bytes by stage: local (committed on this node), upload (sent to "
            "the bucket), fetch (downloaded from it), referenced (of a LOCAL step's "
            "images, held by older steps' files: neither written nor uploaded again).",
            ["stage"],
            registry=r,
        )
        self.unhealthy = Counter(
            "ckptd_unhealthy_saves",
            "Saves committed on this node holding NaN or Inf values in a floating shard "
            "(any increase: the run diverged; restore(healthy=True) skips them).",
            registry=r,
        )
        self.to_local = Histogram(
            "ckptd_handoff_to_local_seconds",
            "From the handoff (save() returning) to the step being LOCAL.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.to_durable = Histogram(
            "ckptd_handoff_to_durable_seconds",
            "From the handoff to the step being DURABLE in the bucket.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.evictions = Counter(
            "ckptd_evictions",
            "Copies removed by retention or low space, by tier.",
            ["tier"],
            registry=r,
        )
        self.errors = Counter(
            "ckptd_errors",
            "Errors by stage: local (a save failed on this node), drain (an upload "
            "retried or failed), verify (a copy failed its checksum and was set aside).",
            ["stage"],
            registry=r,
        )
        self.restores = Counter(
            "ckptd_restores",
            "Restores served, by the tier the copy came from.",
            ["tier"],
            registry=r,
        )
        r.register(_Gauges(sources, clock))
        # Every series exists at 0 from the start: Prometheus's increase() and rate()
        # see nothing of a series' first sample, so a counter born at 1 on the first
        # failure would never show in a dashboard or fire an alert.
        for counter, values in (
            (self.saves, [*_RESULTS.values(), "superseded"]),
            (self.bytes, ("local", "upload", "fetch")),
            (self.evictions, ("local", "remote")),
            (self.errors, ("local", "drain", "verify")),
            (self.restores, ("memory", "local", "remote")),
        ):
            for value in values:
                counter.labels(value)

    def on_event(self, event: Event, catalog: Steps) -> None:
        """Count one catalog transition (on the loop: a few additions, no I/O)."""
        kind = event.kind
        if kind in _RESULTS:
            self.saves.labels(_RESULTS[kind]).inc()
        elif kind == pb.STEP_EVENT_SUPERSEDED and event.attributes.get("stage") == "local":
            self.saves.labels("superseded").inc()
        st = catalog.get(event.job, event.step)
        size = st.manifest.size_bytes if st is not None and st.manifest is not None else 0
        if kind == pb.STEP_EVENT_LOCAL and st is not None:
            self.bytes.labels("local").inc(size)
            if st.manifest is not None and st.manifest.increment:
                self.bytes.labels("referenced").inc(max(st.manifest.image_bytes - size, 0))
            if st.healthy is False:
                self.unhealthy.inc()
            if st.handoff_at and st.local_at >= st.handoff_at:
                self.to_local.observe(st.local_at - st.handoff_at)
        elif kind == pb.STEP_EVENT_DURABLE and st is not None:
            self.bytes.labels("upload").inc(size)
            if st.handoff_at and st.durable_at >= st.handoff_at:
                self.to_durable.observe(st.durable_at - st.handoff_at)
        elif kind == pb.STEP_EVENT_FETCHED:
            self.bytes.labels("fetch").inc(size)
        elif kind == pb.STEP_EVENT_EVICTED_LOCAL:
            self.evictions.labels("local").inc()
        elif kind == pb.STEP_EVENT_EVICTED_REMOTE:
            self.evictions.labels("remote").inc()
        elif kind == pb.STEP_EVENT_FAILED:
            self.errors.labels(event.attributes.get("stage") or "local").inc()
        elif kind == pb.STEP_EVENT_RETRYING:
            self.errors.labels("drain").inc()
        elif kind == pb.STEP_EVENT_SET_ASIDE:
            self.errors.labels("verify").inc()

    def restored(self, tier: str) -> None:
        """A Restore was answered from ``tier`` (local, or remote: fetched for it)."""
        self.restores.labels(tier).inc()

    def exposition(self) -> bytes:
        """The text a scrape gets."""
        return generate_latest(self.registry)


class _Gauges(Collector):
    """Values read when scraped, so they are never stale."""

    def __init__(self, sources: Sources, clock: Callable[[], float]) -> None:
        self.s = sources
        self._clock = clock

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # values depend on the jobs present; described when collected

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        now = self._clock()
        status = self.s.status()
        info = GaugeMetricFamily("ckptd_build_info", "Version of this daemon.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        if not self.s.started():
            return
        yield from self._exposure(now)
        yield _gauge("ckptd_drain_queue_steps", "Steps waiting to be uploaded.", status.drain_queue)
        yield _gauge(
            "ckptd_drain_lag_seconds",
            "How long the oldest LOCAL step not yet in the bucket has waited.",
            self.s.drain_lag(),
        )
        yield _gauge(
            "ckptd_saves_in_flight", "Saves handed off, not yet LOCAL.", status.saves_in_flight
        )
        tier_bytes = GaugeMetricFamily(
            "ckptd_tier_bytes", "Bytes of checkpoints held, by tier.", labels=["tier"]
        )
        tier_bytes.add_metric(["local"], status.local_used_bytes)
        if status.memory_tier_steps:  # rank files kept in shared memory
            tier_bytes.add_metric(["memory"], status.memory_tier_bytes)
        peer_tier = bool(status.peer_address or status.peers_known or status.replicated_bytes)
        if peer_tier:  # replicas this node holds for its peers
            tier_bytes.add_metric(["peer"], status.replicas_held_bytes)
        yield tier_bytes
        steps = GaugeMetricFamily("ckptd_tier_steps", "Steps held, by tier.", labels=["tier"])
        all_steps = self.s.catalog.steps()
        steps.add_metric(["local"], sum(1 for st in all_steps if st.local))
        if status.memory_tier_steps:
            steps.add_metric(["memory"], sum(1 for st in all_steps if st.in_memory))
        if self.s.remote:
            steps.add_metric(["remote"], sum(1 for st in all_steps if st.in_remote))
        if peer_tier:  # this node's steps with a replica on a peer
            steps.add_metric(["peer"], sum(1 for st in all_steps if st.replica_nodes))
        yield steps
        if status.memory_tier_steps:
            yield CounterMetricFamily(
                "ckptd_memory_tier_evictions",
                "Rank files the memory tier let go: for a save's memory, a newer step, "
                "memory_tier_bytes, or a copy that failed its check.",
                value=status.memory_tier_evicted,
            )
        if peer_tier:
            peer = CounterMetricFamily(
                "ckptd_peer_bytes",
                "Peer tier bytes: sent (replicas of this node's steps), fetched (taken "
                "back from peers after a lost disk), received (replicas of peers' steps "
                "taken) and served (replica files read by restoring peers).",
                labels=["direction"],
            )
            peer.add_metric(["sent"], status.replicated_bytes)
            peer.add_metric(["fetched"], status.peer_fetched_bytes)
            peer.add_metric(["received"], status.peer_received_bytes)
            peer.add_metric(["served"], status.peer_served_bytes)
            yield peer
        yield _gauge(
            "ckptd_local_free_bytes",
            "Free bytes on the local tier's disk.",
            status.local_free_bytes,
        )
        yield _gauge(
            "ckptd_local_low_watermark_bytes",
            "Free space below which the evictor removes copies the bucket holds.",
            status.local_low_watermark_bytes,
        )
        staging = GaugeMetricFamily(
            "ckptd_staging_bytes",
            "Shared memory: budget, allocated (segments) and in_use (leases).",
            labels=["kind"],
        )
        staging.add_metric(["budget"], status.staging_budget_bytes)
        staging.add_metric(["allocated"], status.staging_allocated_bytes)
        staging.add_metric(["in_use"], status.staging_in_use_bytes)
        yield staging
        restarts = CounterMetricFamily(
            "ckptd_task_restarts", "Restarts of a background service.", labels=["task"]
        )
        up = GaugeMetricFamily(
            "ckptd_task_up", "1 if a background service is running.", labels=["task"]
        )
        for task in status.tasks:
            restarts.add_metric([task.name], task.restarts)
            up.add_metric([task.name], 1 if task.state == "running" else 0)
        yield restarts
        yield up

    def _exposure(self, now: float) -> Iterator[GaugeMetricFamily]:
        """Per running job: now minus the newest complete step's time in each tier
        (with job labels off: per tier, the largest over the running jobs)."""
        labelled = self.s.job_labels()
        family = GaugeMetricFamily(
            "ckptd_exposure_seconds",
            "Now minus the time of the newest complete checkpoint in the tier: the "
            "training a failure now would cost (running jobs only; without a job label: "
            "the node's worst running job).",
            labels=["job", "tier"] if labelled else ["tier"],
        )
        steps = self.s.catalog.steps()
        live = set(self.s.live_jobs())
        live.update(st.job for st in steps if st.state == pb.SAVE_STATE_STAGING)
        newest: dict[tuple[str, str], float] = {}
        for st in steps:
            # Adopted steps count too: an Orbax job's exposure is its adopted steps'.
            when = st.handoff_at or st.created_unix  # when the state was captured
            if not when or st.job not in live:
                continue
            tiers = (
                (["memory"] if st.in_memory else [])
                + (["local"] if st.local else [])
                + (["remote"] if st.in_remote else [])
                + (["peer"] if st.replica_nodes else [])
            )
            for tier in tiers:
                key = (st.job, tier)
                newest[key] = max(newest.get(key, 0.0), when)
        if labelled:
            for (job, tier), when in sorted(newest.items()):
                family.add_metric([job, tier], max(0.0, now - when))
        else:
            worst: dict[str, float] = {}
            for (_, tier), when in newest.items():
                worst[tier] = max(worst.get(tier, 0.0), max(0.0, now - when))
            for tier, seconds in sorted(worst.items()):
                family.add_metric([tier], seconds)
        yield family


def job_labels_shown(setting: str, owners: Collection[int], shared: bool) -> bool:
    """``metrics_job_labels``: ``on``/``off``; ``auto``: on unless several uids use the
    daemon (``owners``: each job's owner, and the uids saving now: root and the
    daemon's uid own no job but their job names are as private) or the config lets
    several users share jobs (``shared``: allow_uids, allow_gids or shared_jobs set)."""
    if setting != "auto":
        return setting == "on"
    return not shared and len(set(owners)) <= 1


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
