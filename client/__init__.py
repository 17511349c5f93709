"""ckptd client: what a trainer imports to save to and restore from the node daemon."""

from .client import CheckpointInfo, Client, SaveHandle
from .errors import CheckpointCorrupt, CheckpointNotFound, CkptdError, CkptdUnavailable, SaveFailed

__all__ = [
    "CheckpointCorrupt",
    "CheckpointInfo",
    "CheckpointNotFound",
    "CkptdError",
    "CkptdUnavailable",
    "Client",
    "SaveFailed",
    "SaveHandle",
]
