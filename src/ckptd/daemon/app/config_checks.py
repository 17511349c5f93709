"""Checks of a loaded configuration that look at several keys, or at more than a value's type.

Kept apart from ``config.py`` (parsing, sources, defaults) so each stays readable;
every message names the key and says what is accepted.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ckptd.core.errors import InvalidArgument
from ckptd.core.names import MAX_NODE_BYTES, check_name
from ckptd.core.redact import has_credentials, redact
from ckptd.core.session import session_path

from .http import parse_address

if TYPE_CHECKING:
    from .config_fields import Config

LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(InvalidArgument):
    """A configuration value is missing, unknown or invalid."""


def validate(cfg: Config) -> None:
    """Raise :class:`ConfigError` for values that parse but do not make sense together."""
    try:
        check_name("node_id", cfg.node_id, MAX_NODE_BYTES)
    except InvalidArgument as exc:
        raise ConfigError(f"invalid value for 'node_id': {exc}") from None
    if not 0 <= cfg.io_nice <= 19:
        raise ConfigError(
            f"invalid value for 'io_nice': {cfg.io_nice}; use 0 (no change) to 19 (lowest)"
        )
    for key in ("remote", "remote_endpoint_url"):
        if has_credentials(getattr(cfg, key)):
            raise ConfigError(
                f"invalid value for {key!r}: {redact(getattr(cfg, key))} carries credentials; "
                "remove them from the URL and give them the standard way (AWS_* environment "
                "variables, ~/.aws, GOOGLE_APPLICATION_CREDENTIALS or the instance's role)"
            )
    if cfg.remote and not re.match(r"^(s3|gs)://[^/]+|^file:///", cfg.remote):
        raise ConfigError(
            f"invalid value for 'remote': {cfg.remote!r}; use s3://BUCKET/PREFIX, "
            "gs://BUCKET/PREFIX or file:///ABSOLUTE/PATH"
        )
    if cfg.node_claim_stale_seconds <= cfg.node_claim_heartbeat_seconds:
        raise ConfigError(
            f"invalid value for 'node_claim_stale_seconds': {cfg.node_claim_stale_seconds}; "
            "use more than node_claim_heartbeat_seconds "
            f"({cfg.node_claim_heartbeat_seconds}), e.g. three times it: a live daemon's "
            "claim would be taken over between two of its heartbeats"
        )
    if cfg.part_size_bytes < 5 * 2**20 or cfg.part_size_bytes % 4096:
        raise ConfigError(
            f"invalid value for 'part_size_bytes': {cfg.part_size_bytes}; use a multiple of "
            "4 KiB of at least 5 MiB (the minimum part size of S3 multipart uploads)"
        )
    if not 0.05 <= cfg.adopt_poll_seconds <= 3600:
        raise ConfigError(
            f"invalid value for 'adopt_poll_seconds': {cfg.adopt_poll_seconds}; "
            "use 0.05 to 3600 seconds"
        )
    if cfg.log_level not in LOG_LEVELS:
        raise ConfigError(
            f"invalid value for 'log_level': {cfg.log_level!r}; use one of {LOG_LEVELS}"
        )
    if len(session_path(str(cfg.socket)).encode()) > 107:
        raise ConfigError(
            f"invalid value for 'socket': {cfg.socket} plus '.session' (the session socket "
            "beside it) is longer than the 107 bytes a unix socket path may have; choose a "
            "shorter path"
        )
    try:
        parse_address(cfg.metrics_address)
    except ValueError as exc:
        raise ConfigError(f"invalid value for 'metrics_address': {exc}") from None
    if cfg.metrics_job_labels not in ("auto", "on", "off"):
        raise ConfigError(
            f"invalid value for 'metrics_job_labels': {cfg.metrics_job_labels!r}; use auto "
            "(job names unless several users share this daemon), on or off"
        )
    if cfg.peer_address != "off":
        try:
            parse_address(cfg.peer_address)
        except ValueError as exc:
            raise ConfigError(f"invalid value for 'peer_address': {exc}") from None
    if (cfg.peers or cfg.peer_address != "off") and not cfg.peer_token_file:
        raise ConfigError(
            "peer_address or peers is set but peer_token_file is not: give every daemon "
            "of the job the same file holding a random token (`openssl rand -hex 32`)"
        )
    tls = (cfg.peer_tls_cert_file, cfg.peer_tls_key_file, cfg.peer_tls_ca_file)
    if any(tls) and not all(tls):
        raise ConfigError(
            "peer TLS needs all of peer_tls_cert_file, peer_tls_key_file and "
            "peer_tls_ca_file (the node's certificate, its key, the peers' CA)"
        )
    if cfg.peer_idle_seconds <= cfg.peer_max_lag_seconds:
        raise ConfigError(
            f"invalid value for 'peer_idle_seconds': {cfg.peer_idle_seconds}; it must exceed "
            f"peer_max_lag_seconds ({cfg.peer_max_lag_seconds}), or a replica whose sender "
            "pauses for its saves is dropped"
        )
    for entry in cfg.peers:
        if not re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):[0-9]{1,5}", entry):
            raise ConfigError(f"invalid value for 'peers': {entry!r}; use HOST:PORT entries")
    for pattern in cfg.shared_jobs:
        if "/" in pattern or not pattern:
            raise ConfigError(f"invalid value for 'shared_jobs': {pattern!r} is not a job pattern")
    if cfg.sessions_per_uid < 0:
        raise ConfigError(
            f"invalid value for 'sessions_per_uid': {cfg.sessions_per_uid}; use a number of "
            "sessions, or 0 for three quarters of the daemon's session limit"
        )
