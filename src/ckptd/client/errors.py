"""Exceptions raised by :class:`ckptd.client.Client`, carrying the daemon's message.

They are the classes of the one error table in :mod:`ckptd.core.errors`, under
the names trainers catch: a status the daemon sends back becomes the same class
the daemon raised.
"""

from ckptd.core.errors import (
    CapacityExhausted,
    CheckpointCorrupt,
    CheckpointNotFound,
    CkptdError,
    CkptdUnavailable,
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    SaveFailed,
    TreeMismatch,
)

__all__ = [
    "CapacityExhausted",
    "CheckpointCorrupt",
    "CheckpointNotFound",
    "CkptdError",
    "CkptdUnavailable",
    "Conflict",
    "FailedPrecondition",
    "InvalidArgument",
    "SaveFailed",
    "TreeMismatch",
]
