"""The step catalog: the one owner of every step's state, its transition table and events."""

from .catalog import Catalog
from .events import HISTORY, MAX_WAIT_SECONDS, EventLog, Listener
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
    "EventLog",
    "IllegalTransition",
    "Listener",
    "Step",
]
