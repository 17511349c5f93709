"""Exceptions raised by :class:`ckptd.client.Client`, carrying the daemon's message.

They are the classes of the one error table in :mod:`ckptd.core.errors`, each
under its one public name (the name tracebacks print, ``ckptd.client.<Name>``): a
status the daemon sends back becomes the same class the daemon raised.
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
    PermissionDenied,
    SaveFailed,
    TreeMismatch,
    Unauthenticated,
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
    "PermissionDenied",
    "SaveFailed",
    "TreeMismatch",
    "Unauthenticated",
]
