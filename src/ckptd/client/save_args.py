"""A save's arguments checked before anything is leased: the step, the metrics
``KeepBest`` ranks by, and the metadata as JSON."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ckptd.core.health import RESERVED_PREFIX


def save_args(
    step: Any, metrics: dict[str, float] | None, metadata: dict[str, Any] | None
) -> tuple[int, dict[str, float], str]:
    """A save's step, metrics and metadata (as JSON), checked."""
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(f"step must be a non-negative int, not {step!r}")
    if metadata is not None and not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict, not {type(metadata).__name__}")
    try:
        metadata_json = json.dumps(metadata or {})
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata must be a JSON-serialisable dict: {exc}") from None
    return int(step), check_metrics(metrics), metadata_json


def check_metrics(metrics: dict[str, float] | None) -> dict[str, float]:
    """``metrics`` as names to floats; a clear error for anything else."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise TypeError(f"metrics must be a dict of name -> number, not {type(metrics).__name__}")
    out = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or isinstance(value, bool):
            raise TypeError(f"metric {name!r}: names must be str and values numbers")
        if name.startswith(RESERVED_PREFIX):
            raise ValueError(
                f"metric {name!r}: names starting with {RESERVED_PREFIX!r} are set by the "
                "daemon (ckptd.nonfinite: the step's NaN/Inf count); rename it"
            )
        try:
            out[name] = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"metric {name!r} = {value!r} is not a number") from None
    return out
