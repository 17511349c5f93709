"""The step catalog: the one owner of every step's state, its transition table and events."""

from .catalog import HISTORY, MAX_WAIT_SECONDS, Catalog, Listener
from .step import (
    DRAINING,
    DURABLE,
    FAILED,
    LOCAL,
    NEW,
    STAGING,
    SUPERSEDED,
    TRANSITIONS,
    Event,
    IllegalTransition,
    Step,
)

__all__ = [
    "DRAINING",
    "DURABLE",
    "FAILED",
    "HISTORY",
    "LOCAL",
    "MAX_WAIT_SECONDS",
    "NEW",
    "STAGING",
    "SUPERSEDED",
    "TRANSITIONS",
    "Catalog",
    "Event",
    "IllegalTransition",
    "Listener",
    "Step",
]
