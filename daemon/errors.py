"""Domain errors raised by the daemon, and their one mapping to gRPC status codes.

Every message says what went wrong and what the caller can do about it; the
servicer sends it verbatim to the client.
"""

from __future__ import annotations

import grpc


class CkptdError(Exception):
    """Base class: a failure the caller can act on."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(CkptdError):
    """The request is malformed (bad name, offsets outside the lease, ...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(CkptdError):
    """The lease, job or step does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class Conflict(CkptdError):
    """The thing already exists (a second commit of the same step and rank)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(CkptdError):
    """Out of staging budget or disk space."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(CkptdError):
    """The daemon is not in a state to do this (wrong protocol, no remote, ...)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class DataLoss(CkptdError):
    """Every copy of the requested checkpoint is corrupt or incomplete."""

    code = grpc.StatusCode.DATA_LOSS


class Unavailable(CkptdError):
    """The daemon is shutting down; retry against the next instance."""

    code = grpc.StatusCode.UNAVAILABLE
