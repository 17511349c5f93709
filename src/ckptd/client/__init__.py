"""ckptd client: what a trainer imports to save to and restore from the node daemon."""

from .client import Client
from .errors import (
    CapacityExhausted,
    CheckpointCorrupt,
    CheckpointNotFound,
    CkptdError,
    CkptdUnavailable,
    SaveFailed,
    TreeMismatch,
)
from .goodput import Goodput
from .handle import CheckpointInfo, SaveHandle
from .policies import (
    AnyOf,
    Continuous,
    FailureHistory,
    FixedInterval,
    SaveContext,
    SavePolicy,
    SpecificSteps,
)

__all__ = [
    "AnyOf",
    "CapacityExhausted",
    "CheckpointCorrupt",
    "CheckpointInfo",
    "CheckpointNotFound",
    "CkptdError",
    "CkptdUnavailable",
    "Client",
    "Continuous",
    "FailureHistory",
    "FixedInterval",
    "Goodput",
    "SaveContext",
    "SaveFailed",
    "SaveHandle",
    "SavePolicy",
    "SpecificSteps",
    "TreeMismatch",
]
