"""Exceptions raised by :class:`ckptd.client.Client`, carrying the daemon's message."""

from __future__ import annotations

import grpc


class CkptdError(Exception):
    """A request to the daemon failed; ``str(exc)`` is the daemon's reason."""

    def __init__(self, message: str, code: str = "UNKNOWN") -> None:
        super().__init__(message)
        self.code = code


class CkptdUnavailable(CkptdError):
    """The daemon cannot be reached (not running, wrong socket, restarting)."""


class SaveFailed(CkptdError):
    """A save was acknowledged but could not be committed; the reason says why."""


class CheckpointNotFound(CkptdError):
    """No such step (or no restorable step at all) for the job."""


class CheckpointCorrupt(CkptdError):
    """Every copy of the requested step failed its checksum check."""


class CapacityExhausted(CkptdError):
    """No room for a save: staging memory held by earlier saves, or local disk below
    its floor. The message says how much is needed and what to change."""


_BY_CODE: dict[grpc.StatusCode, type[CkptdError]] = {
    grpc.StatusCode.UNAVAILABLE: CkptdUnavailable,
    grpc.StatusCode.NOT_FOUND: CheckpointNotFound,
    grpc.StatusCode.DATA_LOSS: CheckpointCorrupt,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExhausted,
}


def from_rpc_error(exc: grpc.RpcError, socket: str) -> CkptdError:
    """Convert a gRPC error into the matching :class:`CkptdError`."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE and "ckptd" not in (details or ""):
        details = (
            f"cannot reach the ckptd daemon at {socket}: is `ckptd serve` running there? "
            f"(set CKPTD_SOCKET or pass socket=...; gRPC said: {details})"
        )
    return _BY_CODE.get(code, CkptdError)(details or str(code), code.name)
