"""ckptd client: what a trainer imports to save to and restore from the node daemon."""

from .client import Client
from .errors import (
    CapacityExhausted,
    CheckpointCorrupt,
    CheckpointNotFound,
    CkptdError,
    CkptdUnavailable,
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    SaveFailed,
    TreeMismatch,
    Unauthenticated,
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
    "Conflict",
    "Continuous",
    "FailedPrecondition",
    "FailureHistory",
    "FixedInterval",
    "Goodput",
    "InvalidArgument",
    "PermissionDenied",
    "SaveContext",
    "SaveFailed",
    "SaveHandle",
    "SavePolicy",
    "SpecificSteps",
    "TreeMismatch",
    "Unauthenticated",
]
