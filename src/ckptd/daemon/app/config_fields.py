"""The daemon's configuration: the application's own keys, and the flat
:class:`Config` composed of every tier's.

Each key is declared once, in the option group of the tier that uses it
(``local/options.py``, ``remote/options.py``, ``peer/options.py``,
``lifecycle/options.py``, ``api/options.py``, and here the application's): its
name, type, default and documentation. :class:`Config` inherits every group, so
it is the flat set of keys users write (config file, ``CKPTD_*``, flags) without
declaring one itself; the parser (config.py), the flags and help (cli_help.py)
and docs/reference/configuration.md are generated from it, and the composition
root cuts it back into the groups (options.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckptd.core.wire import DEFAULT_SOCKET  # one default for both sides

from ..api.options import ApiOptions
from ..lifecycle.options import LifecycleOptions
from ..local.options import DEFAULT_ROOT as DEFAULT_ROOT
from ..local.options import LocalOptions
from ..peer.options import PeerOptions
from ..remote.options import RemoteOptions

DEFAULT_METRICS_ADDRESS = "127.0.0.1:9464"


@dataclass(frozen=True)
class ServeOptions:
    """The application's own keys: where the API listens, how much it logs."""

    socket: Path = Path(DEFAULT_SOCKET)
    """Unix socket the gRPC API listens on (mode 0660)."""
    log_level: str = "info"
    """One of debug, info, warning, error."""


@dataclass(frozen=True)
class MetricsOptions:
    """What the HTTP endpoints (/metrics, /healthz, /readyz) are configured with."""

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


@dataclass(frozen=True)
class Config(
    MetricsOptions,
    ApiOptions,
    PeerOptions,
    LifecycleOptions,
    RemoteOptions,
    LocalOptions,
    ServeOptions,
):
    """Everything ``ckptd serve`` needs, as one flat set of keys: every group's, in
    the order of the groups (the application's, then the local tier's, the remote
    tier's, the lifecycle's, the peer tier's, the API's, the metrics'), each group's
    in its own order. Declares nothing itself; docs/reference/configuration.md is
    generated from it."""


GROUPS: tuple[type, ...] = tuple(
    base for base in reversed(Config.__mro__[1:]) if "__dataclass_fields__" in vars(base)
)
"""The option groups :class:`Config` is made of, in its order."""
