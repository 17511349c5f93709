"""Typed, validated daemon configuration: embedded defaults < file < ``CKPTD_*`` env < flags.

Every error names the offending key and its source, and says what is accepted.
Values are never silently rewritten: a bad value stops start-up. Retention
policies and free-space marks are parsed here, once, into typed values.
"""

from __future__ import annotations

import dataclasses
import difflib
import grp
import os
import pwd
import re
import socket as _socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.core.wire import DEFAULT_SOCKET  # one default for both sides

from ..local.admission import SpaceMark, parse_size
from ..retention.policies import Policy, PolicyError, parse_policy
from .config_checks import ConfigError as ConfigError  # re-exported: callers import it from here
from .config_checks import validate
from .config_sources import ENV_PREFIX as ENV_PREFIX  # re-exported: the CLI reads it here
from .config_sources import override_line, refuse_unknown, shown, unknown_variables

DEFAULT_ROOT = "/var/lib/ckptd"
DEFAULT_METRICS_ADDRESS = "127.0.0.1:9464"


def _default_node_id() -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", _socket.gethostname()) or "node"
    return name.lstrip(".")[:63] or "node"


@dataclass(frozen=True)
class Config:
    """Everything ``ckptd serve`` needs; docs/reference/configuration.md is generated from it."""

    root: Path = Path(DEFAULT_ROOT)
    """Local tier directory (on NVMe). Holds ``<job>/<step>/`` and ``.staging``."""
    socket: Path = Path(DEFAULT_SOCKET)
    """Unix socket the gRPC API listens on (mode 0660)."""
    node_id: str = field(default_factory=_default_node_id)
    """This node's name in manifests and remote markers (defaults to the host name)."""
    staging_budget_bytes: int = 4 * 2**30
    """Most shared memory the daemon may hold in leases at once."""
    staging_share_per_uid: float = 1.0
    """Most of ``staging_budget_bytes`` one uid's leases may hold at once, as a
    fraction (above 0, at most 1; 1: no cap but the budget). Whatever the value,
    while another uid waits for staging memory, a uid already holding leases gets
    no new one past an even split of the budget among the uids holding or waiting."""
    lease_timeout_seconds: float = 600.0
    """A lease held this long without a commit is reclaimed (clients of this release
    are watched directly: their leases come back as soon as they exit)."""
    step_timeout_seconds: float = 600.0
    """A multi-rank step some of whose ranks never hand off fails after this long
    (counted from its first handoff, or from a restart that replayed it)."""
    write_workers: int = 2
    """Threads writing shard files to the local tier in parallel."""
    io_nice: int = 10
    """Nice value (0-19) of the daemon's write, read and checksum threads: they yield
    the host's cores to the trainer (0: the daemon's own priority)."""
    log_level: str = "info"
    """One of debug, info, warning, error."""
    remote: str = ""
    """Remote tier: ``s3://BUCKET/PREFIX``, ``gs://BUCKET/PREFIX`` or ``file:///PATH``.
    Empty: local tier only (a warning at start-up)."""
    remote_endpoint_url: str = ""
    """Endpoint override for S3-compatible stores or the GCS emulator (else the
    standard AWS_ENDPOINT_URL_S3 / STORAGE_EMULATOR_HOST variables apply)."""
    drain_concurrency: int = 8
    """Parts uploaded (and ranged reads downloaded) in parallel."""
    part_size_bytes: int = 16 * 2**20
    """Size of one upload part / ranged read (S3 needs at least 5 MiB)."""
    drain_retry_max_seconds: float = 30.0
    """Longest pause between retries of a transient remote error (backoff doubles up to it);
    also the first pause before a failed upload is tried again (doubling to ten minutes)."""
    drain_stall_seconds: float = 45.0
    """An upload with no file finished for this long shows as the drain's error in
    status (a store that hangs without answering)."""
    remote_read_jitter_seconds: float = 0.0
    """Before its first read of the bucket for a job (at start-up, or a restore on a
    node that holds none of it), the daemon waits a random time up to this long, so a
    whole job restarting at once does not reach the bucket in the same second (0: no
    wait; docs/scale.md: nodes / 2,000 at 1,000 nodes and more)."""
    node_claim_heartbeat_seconds: float = 300.0
    """How often the daemon refreshes its claim on ``node_id`` in the bucket (one
    conditional PUT: docs/scale.md counts them)."""
    node_claim_stale_seconds: float = 900.0
    """A claim on the node name not refreshed for this long is taken over by another
    daemon with that name (a replacement node); must exceed the heartbeat."""
    node_claim_takeover: bool = False
    """Take the node name's claim at start-up even if another daemon's is fresh: for
    an operator who knows the old daemon is gone (its disk and host lost)."""
    retention_local: Policy = field(default_factory=lambda: parse_policy("KeepLatest(3)"))
    """Which checkpoints the local tier keeps (see daemon/retention/policies.py)."""
    retention_remote: Policy = field(
        default_factory=lambda: parse_policy("KeepAny([KeepLatest(3), KeepMilestones()])")
    )
    """Which checkpoints the remote tier keeps; milestones are always kept there."""
    local_evict_unuploaded: bool = False
    """Let the local retention evict a copy whose remote copy is not complete yet
    (milestones excepted). Off: such copies wait for the drain."""
    local_low_watermark: SpaceMark = field(default_factory=lambda: SpaceMark.parse("10%"))
    """Free space (bytes, '20GiB' or '10%' of the disk) below which the evictor also
    removes local copies the local policy keeps but the bucket holds, oldest first."""
    local_floor: SpaceMark = field(default_factory=lambda: SpaceMark.parse("1GiB"))
    """Free space a save must leave on the local disk; saves that would go below it
    are refused with RESOURCE_EXHAUSTED."""
    adopt_poll_seconds: float = 0.25
    """How often watched directories (a job's Orbax directory) are scanned for
    finished steps to adopt."""
    adopt_dirs: tuple[Path, ...] = ()
    """Directories (absolute; symlinks resolved at start-up) in which Adopt, Watch and
    EnsureLocal may act, on files the calling process could read or write itself.
    Empty: only each job's own Orbax directory under the root (``<root>/.orbax/<job>``)."""
    socket_group: str = ""
    """Group (name or gid) given to the socket, its session socket and its directory:
    the users who may call the daemon. Empty: the daemon's own group."""
    allow_uids: tuple[int, ...] = ()
    """Users (uids or names) who may use every job; a job otherwise belongs to the uid
    that first used it (root and the daemon's uid may use every job)."""
    allow_gids: tuple[int, ...] = ()
    """Groups (gids or names) whose members may use every job."""
    shared_jobs: tuple[str, ...] = ()
    """Job name patterns (fnmatch: ``team-*``) that anyone who reaches the socket may use."""
    sessions_per_uid: int = 0
    """Sessions (connected clients) one uid may hold at once; root and the daemon's
    uid are not counted. 0: three quarters of the daemon's session limit (a quarter
    of its fd limit), so one user cannot take every slot from the others while a
    single-user node keeps room for all its clients."""
    peer_address: str = "off"
    """``HOST:PORT`` (TCP) where the Peer service takes and serves replicas of other
    daemons' steps; ``off``: none (port 0: any free port, shown in status)."""
    peer_data_port: int = 0
    """TCP port (on ``peer_address``'s host) of the listener that serves replica bytes
    to restoring nodes (sendfile, ~3x gRPC's rate); 0: any free port, told to peers by
    the Peer service; -1: none (the bytes go through the Peer service: one port)."""
    peers: tuple[str, ...] = ()
    """The other daemons of the job, ``HOST:PORT`` each (a name resolving to several
    addresses, a Kubernetes headless Service's, counts each); this one is skipped."""
    peer_replicas: int = 1
    """How many peers get a replica of each job's newest local step."""
    peer_token_file: str = ""
    """File holding the token every daemon of the job shares; required with
    ``peer_address`` or ``peers`` (peer calls without it are refused)."""
    peer_tls_cert_file: str = ""
    """PEM certificate this daemon shows its peers; with ``peer_tls_key_file`` and
    ``peer_tls_ca_file``, peer traffic is mutual TLS (peer/tls.py). Empty: plain TCP."""
    peer_tls_key_file: str = ""
    """PEM private key of ``peer_tls_cert_file``."""
    peer_tls_ca_file: str = ""
    """PEM CA bundle the peers' certificates must chain to."""
    peer_tls_server_name: str = ""
    """Name every peer's certificate holds; empty: the host of its ``peers`` entry."""
    peer_identity: str = "auto"
    """How a replica's sender is proven to be the node it claims (peer/identity.py):
    ``certificate`` (its TLS certificate names the node), ``address`` (it sends from
    that node's ``peers`` address); ``auto``: certificate with the peer_tls_* files
    unless ``peer_tls_server_name`` is set (one certificate shared by every node)."""
    peer_bandwidth_bytes: int = 512 * 2**20
    """Bytes per second replication may send (saves and the drain keep the rest)."""
    peer_max_lag_seconds: float = 30.0
    """Replication yields to saves being written (STAGING), but once a job's replica
    has been behind its newest local step this long it sends regardless (a continuous
    save loop leaves no gap; the replica is the node-loss copy)."""
    peer_budget_bytes: int = 64 * 2**30
    """Disk this daemon gives to replicas of other nodes' steps."""
    peer_bulk_deadline_seconds: float = 120.0
    """Seconds one request to the bulk data listener may take from its connection, a
    ranged read's bytes included (a caller that trickles is cut there); a caller has
    at most 5 s of it to show the token."""
    peer_idle_seconds: float = 300.0
    """Seconds a replica being received may go without a byte before it is dropped
    with its share of ``peer_budget_bytes``; more than ``peer_max_lag_seconds`` (a
    sender pauses for its node's saves that long)."""
    metrics_address: str = DEFAULT_METRICS_ADDRESS
    """``HOST:PORT`` of the HTTP endpoint with ``/metrics`` (Prometheus), ``/healthz`` and
    ``/readyz``; ``off`` to serve none. Port 0 picks a free port (shown in status). If
    the default port is taken (another daemon on this host) the daemon starts without
    it and says so; an address set explicitly must be free."""
    metrics_job_labels: str = "auto"
    """Whether ``/metrics`` series carry job names (anyone reaching the port reads
    them): ``on``; ``off`` (exposure per tier only, the worst running job's); ``auto``:
    on unless jobs of several uids use this daemon or ``allow_uids``, ``allow_gids``
    or ``shared_jobs`` is set."""


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _items(value: object) -> list[str]:
    """A TOML array, or a comma-separated string (environment, flags)."""
    raw = value if isinstance(value, list | tuple) else str(value).split(",")
    return [str(v).strip() for v in raw if str(v).strip()]


def _principal(text: str, kind: str) -> int:
    """A uid or gid given as a number or a name."""
    if text.isascii() and text.isdigit():
        return int(text)
    try:
        return pwd.getpwnam(text).pw_uid if kind == "user" else grp.getgrnam(text).gr_gid
    except KeyError:
        raise ValueError(f"no {kind} named {text!r} on this host") from None


def _coerce(key: str, value: object, source: str) -> Any:
    kind = _FIELDS[key].type
    try:
        if kind == "tuple[Path, ...]":
            paths = [Path(v).expanduser() for v in _items(value)]
            if not all(p.is_absolute() for p in paths):
                raise ValueError("expected absolute paths")
            return tuple(Path(os.path.realpath(p)) for p in paths)
        if kind == "tuple[int, ...]":
            who = "user" if key.endswith("uids") else "group"
            return tuple(_principal(v, who) for v in _items(value))
        if kind == "tuple[str, ...]":
            return tuple(_items(value))
        if key == "socket_group" and str(value):
            return str(_principal(str(value), "group"))
        if kind == "Path":
            if not str(value):
                raise ValueError("expected a path, got an empty string")
            return Path(str(value)).expanduser()
        if kind == "Policy":
            try:
                return parse_policy(str(value))
            except PolicyError as exc:
                raise ValueError(str(exc)) from None
        if kind == "SpaceMark":
            return SpaceMark.parse(value)
        if key.endswith("_bytes"):
            size = parse_size(value)
            if size <= 0:
                raise ValueError("must be positive")
            return size
        if kind == "bool":
            text = str(value).lower()
            if text not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError("expected true or false")
            return text in ("true", "1", "yes")
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError("expected an integer, got a boolean")
            n = int(str(value))
            if key == "io_nice":  # 0 is meaningful here (no change); the range is checked later
                if n < 0:
                    raise ValueError("must be 0 (no change) to 19 (lowest)")
                return n
            if key == "peer_data_port":  # 0: any free port, -1: none
                if not -1 <= n <= 65535:
                    raise ValueError("must be a TCP port, 0 (any free port) or -1 (none)")
                return n
            if n <= 0:
                raise ValueError("must be a positive integer")
            return n
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError("expected a number, got a boolean")
            x = float(str(value))
            if key == "remote_read_jitter_seconds":  # 0: no jitter
                if not 0 <= x <= 600:
                    raise ValueError("must be 0 (no jitter) to 600 seconds")
                return x
            if key == "staging_share_per_uid" and not 0 < x <= 1:
                raise ValueError("use a fraction of staging_budget_bytes above 0 and at most 1")
            if not x > 0:
                raise ValueError("must be a positive number of seconds")
            return x
        return str(value)
    except ValueError as exc:
        raise ConfigError(f"invalid value for {key!r} from {source}: {exc}") from None


def _check_key(key: str, source: str) -> None:
    if key not in _FIELDS:
        close = difflib.get_close_matches(key, list(_FIELDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"unknown config key {key!r} in {source}{hint} (valid keys: {', '.join(_FIELDS)})"
        )


def load_file(path: Path) -> dict[str, Any]:
    """Read a TOML config file into raw key/value pairs."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None


def load(
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, object] | None = None,
    overrides: list[str] | None = None,
) -> Config:
    """Merge the sources (later wins) and validate the result.

    ``overrides``, when given, receives one line per value a later source replaced
    with a different one (:func:`override_line`): the Dockerfile's or a unit's
    ``CKPTD_ROOT`` beating the operator's config file must not go unsaid."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    given: dict[str, str] = {}  # key -> "<source> <raw value>" of the value in force
    if config_file is None and env.get(ENV_PREFIX + "CONFIG"):
        config_file = Path(env[ENV_PREFIX + "CONFIG"])

    def put(key: str, value: Any, source: str, shown: str) -> None:
        coerced = _coerce(key, value, source)
        if overrides is not None and key in given and values[key] != coerced:
            overrides.append(override_line(key, shown, given[key]))
        values[key], given[key] = coerced, shown

    if config_file is not None:
        source = f"config file {config_file}"
        for key, value in load_file(config_file).items():
            _check_key(key, source)
            put(key, value, source, f"config file {config_file}'s {shown(value)}")
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "CONFIG":
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key in _FIELDS:
            source = f"environment variable {name}"
            put(key, value, source, f"{source}={shown(value)}")
    for key, value in (flags or {}).items():
        if value is not None:
            _check_key(key, "flags")
            flag = f"flag --{key.replace('_', '-')}"
            put(key, value, flag, f"{flag}={shown(value)}")
    cfg = Config(**values)
    validate(cfg)
    return cfg


def unknown_env(env: Mapping[str, str] | None = None) -> list[str]:
    """One line for each ``CKPTD_*`` variable that is no config key (a typo would
    otherwise be silently ignored), with the closest key when there is one."""
    return unknown_variables(os.environ if env is None else env, _FIELDS)


def refuse_unknown_env(env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`ConfigError` (exit 2) if a ``CKPTD_*`` variable is no setting."""
    refuse_unknown(os.environ if env is None else env, _FIELDS)


def field_docs() -> dict[str, str]:
    """Each key's help: the first sentence of its docstring in :class:`Config`."""
    import ast
    import inspect
    import itertools

    docs: dict[str, str] = {}
    body = ast.parse(inspect.getsource(Config)).body[0].body  # type: ignore[attr-defined]
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
        ):
            text = " ".join(str(after.value.value).split())
            docs[node.target.id] = text.split(". ")[0].rstrip(".") + "."
    return docs


def default_values() -> dict[str, str]:
    """Each key's built-in default as text (for ``--help``)."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(Config):
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if isinstance(value, Policy):
            value = value.describe()
        elif isinstance(value, SpaceMark):
            value = value.text
        elif isinstance(value, tuple):
            value = ",".join(map(str, value))
        out[f.name] = str(value) if f.name != "node_id" else "the host name"
    return out


def flag_names() -> list[str]:
    """Config keys that ``ckptd serve`` exposes as ``--flags``."""
    return list(_FIELDS)
