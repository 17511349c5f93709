"""The configuration cut into each tier's option group.

Users keep one flat set of keys (config file, ``CKPTD_*``, flags: config.py); the
composition root hands each tier only its own typed, frozen group, whose class
(in the tier's package, so that no tier imports the application floor) declares
those keys (config_fields.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from ..api.options import ApiOptions
from ..lifecycle.options import LifecycleOptions
from ..local.options import LocalOptions
from ..peer.options import PeerOptions
from ..remote.options import RemoteOptions
from .config_fields import Config, MetricsOptions, ServeOptions

G = TypeVar("G")


def group(cls: type[G], cfg: Config) -> G:
    """The keys of ``cfg`` that the group ``cls`` declares, as that group."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    values: dict[str, Any] = {name: getattr(cfg, name) for name in names}
    return cls(**values)


@dataclass(frozen=True)
class Options:
    """Every tier's group, built once from a loaded :class:`Config`."""

    serve: ServeOptions
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
            serve=group(ServeOptions, cfg),
            local=group(LocalOptions, cfg),
            remote=group(RemoteOptions, cfg),
            peer=group(PeerOptions, cfg),
            lifecycle=group(LifecycleOptions, cfg),
            api=group(ApiOptions, cfg),
            metrics=group(MetricsOptions, cfg),
        )
