"""The configuration split into each tier's option group.

Users keep one flat set of keys (config file, ``CKPTD_*``, flags: config.py); the
composition root hands each tier only its own typed, frozen group, defined in the
tier's package so that no tier imports the application floor.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..api.options import ApiOptions, Sharing
from ..lifecycle.options import LifecycleOptions
from ..local.options import LocalOptions
from ..peer.options import PeerOptions, PeerTlsFiles
from ..remote.options import RemoteOptions
from .config_fields import Config


@dataclass(frozen=True)
class MetricsOptions:
    """What the HTTP endpoints (/metrics, /healthz, /readyz) are configured with."""

    address: str
    """``metrics_address``: HOST:PORT to serve them on, or ``off``."""
    job_labels: str
    """``metrics_job_labels``: ``auto``, ``on`` or ``off`` (metrics.py)."""


@dataclass(frozen=True)
class Options:
    """Every tier's group, built once from a loaded :class:`Config`."""

    local: LocalOptions
    remote: RemoteOptions
    peer: PeerOptions
    lifecycle: LifecycleOptions
    api: ApiOptions
    metrics: MetricsOptions

    @classmethod
    def of(cls, cfg: Config) -> Options:
        """The groups of ``cfg`` (already validated: nothing is checked again here)."""
        return cls(
            local=LocalOptions(
                root=cfg.root,
                node_id=cfg.node_id,
                staging_budget_bytes=cfg.staging_budget_bytes,
                staging_share_per_uid=cfg.staging_share_per_uid,
                memory_tier_steps=cfg.memory_tier_steps,
                memory_tier_bytes=cfg.memory_tier_bytes,
                lease_timeout_seconds=cfg.lease_timeout_seconds,
                step_timeout_seconds=cfg.step_timeout_seconds,
                write_workers=cfg.write_workers,
                io_nice=cfg.io_nice,
                low_watermark=cfg.local_low_watermark,
                floor=cfg.local_floor,
                incremental=cfg.incremental,
                incremental_max_files=cfg.incremental_max_files,
                incremental_full_every=cfg.incremental_full_every,
            ),
            remote=RemoteOptions(
                url=cfg.remote,
                endpoint_url=cfg.remote_endpoint_url,
                concurrency=cfg.drain_concurrency,
                part_size_bytes=cfg.part_size_bytes,
                read_jitter_seconds=cfg.remote_read_jitter_seconds,
                claim_heartbeat_seconds=cfg.node_claim_heartbeat_seconds,
                claim_stale_seconds=cfg.node_claim_stale_seconds,
                claim_takeover=cfg.node_claim_takeover,
            ),
            peer=PeerOptions(
                node_id=cfg.node_id,
                root=cfg.root,
                address=cfg.peer_address,
                data_port=cfg.peer_data_port,
                peers=cfg.peers,
                replicas=cfg.peer_replicas,
                token_file=cfg.peer_token_file,
                tls=PeerTlsFiles(
                    cfg.peer_tls_cert_file,
                    cfg.peer_tls_key_file,
                    cfg.peer_tls_ca_file,
                    cfg.peer_tls_server_name,
                ),
                identity=cfg.peer_identity,
                bandwidth_bytes=cfg.peer_bandwidth_bytes,
                max_lag_seconds=cfg.peer_max_lag_seconds,
                budget_bytes=cfg.peer_budget_bytes,
                bulk_deadline_seconds=cfg.peer_bulk_deadline_seconds,
                idle_seconds=cfg.peer_idle_seconds,
            ),
            lifecycle=LifecycleOptions(
                retention_local=cfg.retention_local,
                retention_remote=cfg.retention_remote,
                evict_unuploaded=cfg.local_evict_unuploaded,
                drain_retry_max_seconds=cfg.drain_retry_max_seconds,
                drain_stall_seconds=cfg.drain_stall_seconds,
                adopt_poll_seconds=cfg.adopt_poll_seconds,
                adopt_dirs=cfg.adopt_dirs,
            ),
            api=ApiOptions(
                socket_group=int(cfg.socket_group) if cfg.socket_group else -1,
                sharing=Sharing(cfg.allow_uids, cfg.allow_gids, cfg.shared_jobs),
                sessions_per_uid=cfg.sessions_per_uid,
                session_idle_seconds=cfg.lease_timeout_seconds,
            ),
            metrics=MetricsOptions(address=cfg.metrics_address, job_labels=cfg.metrics_job_labels),
        )
