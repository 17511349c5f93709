"""The one error table: domain error -> gRPC status -> client exception -> CLI line.

The daemon raises these; the servicer turns one into the gRPC status named by its
``status``; the client turns a status back into the same class (``from_status``);
the CLI prints ``ckptd: error: <message>`` and exits with ``exit_code``. Every
message says what went wrong and what the caller can do about it.

Each class has one public name, the one :mod:`ckptd.client` exports and tracebacks
print (``ckptd.client.CkptdUnavailable``); the daemon's code also uses the shorter
aliases below (``NotFound`` is ``CheckpointNotFound``).
"""

from __future__ import annotations

import errno
from typing import ClassVar

import grpc


class CkptdError(Exception):
    """A failure the caller can act on; ``str(exc)`` says what and what to do.

    ``code`` is the gRPC status name the error travelled with (``"NOT_FOUND"``),
    or a stage name for errors the client raises itself (``"FAILED"``).
    """

    status: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    exit_code: ClassVar[int] = 2
    """What ``ckptd`` exits with after printing the error."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code or self.status.name


class InvalidArgument(CkptdError):
    """The request is malformed (a bad name, offsets outside the lease, a bad value)."""

    status = grpc.StatusCode.INVALID_ARGUMENT


class TreeMismatch(InvalidArgument, ValueError):
    """A restore target whose structure differs from the saved tree's (a missing or
    extra entry, another shape, dtype or PRNG implementation); the message names
    the path. Raised by the client, never sent: it travels as INVALID_ARGUMENT.
    Also a ``ValueError``, which restore raised for these before."""


class CheckpointNotFound(CkptdError):
    """No such lease, job or step (or no restorable step at all)."""

    status = grpc.StatusCode.NOT_FOUND


class Conflict(CkptdError):
    """The thing already exists (a second commit of the same step and rank)."""

    status = grpc.StatusCode.ALREADY_EXISTS


class CapacityExhausted(CkptdError):
    """No room: staging memory held by earlier saves, or the local disk below its floor."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(CkptdError):
    """Not possible in the current state (no remote tier, a step still being written...)."""

    status = grpc.StatusCode.FAILED_PRECONDITION


class CheckpointCorrupt(CkptdError):
    """Every copy of the requested checkpoint is corrupt or incomplete."""

    status = grpc.StatusCode.DATA_LOSS


class CkptdUnavailable(CkptdError):
    """The daemon cannot be reached (not running, wrong socket, restarting)."""

    status = grpc.StatusCode.UNAVAILABLE


class PermissionDenied(CkptdError):
    """The calling process may not do this (another uid's job, a path it cannot read)."""

    status = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(CkptdError):
    """The call carried no valid session: the daemon does not know who is calling."""

    status = grpc.StatusCode.UNAUTHENTICATED


class SaveFailed(CkptdError):
    """An acknowledged save could not reach the stage waited for; the reason says why."""

    status = grpc.StatusCode.ABORTED


PUBLIC: tuple[type[CkptdError], ...] = (
    CkptdError,
    InvalidArgument,
    TreeMismatch,
    CheckpointNotFound,
    Conflict,
    CapacityExhausted,
    FailedPrecondition,
    CheckpointCorrupt,
    CkptdUnavailable,
    PermissionDenied,
    Unauthenticated,
    SaveFailed,
)
"""Every error a trainer can catch, each under its one public name in :mod:`ckptd.client`."""
for _cls in PUBLIC:
    # Tracebacks and reprs print ``<module>.<name>``: make that the path a user
    # imports it from (``from ckptd.client import CkptdUnavailable``), not this module.
    _cls.__module__ = "ckptd.client"

# The daemon's shorter names for the same classes (what each stands for on its side).
NotFound = CheckpointNotFound
DataLoss = CheckpointCorrupt
ResourceExhausted = CapacityExhausted
Unavailable = CkptdUnavailable

_BY_STATUS: dict[grpc.StatusCode, type[CkptdError]] = {
    cls.status: cls
    for cls in PUBLIC
    if cls not in (CkptdError, TreeMismatch)  # the base, and one the client raises itself
}


def from_status(status: grpc.StatusCode, message: str) -> CkptdError:
    """The error a gRPC status stands for (a plain :class:`CkptdError` for other codes)."""
    return _BY_STATUS.get(status, CkptdError)(message or status.name, status.name)


def from_os_error(exc: OSError, doing: str) -> CkptdError:
    """The error a failed system call stands for when the cause is outside ckptd (a full
    disk, a path the caller named): ``doing`` says what failed ("cannot write /x/y").

    A plain :class:`CkptdError` (INTERNAL) for errnos that point at a bug instead.
    """
    reason = f"{doing}: {exc.strerror or exc}"
    code = exc.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(f"{reason}; free space on that filesystem and try again")
    if code in (errno.EACCES, errno.EPERM):
        return PermissionDenied(f"{reason}; the daemon's user may not do that there")
    if code == errno.ENOENT:
        return NotFound(f"{reason}; check that the path exists")
    if code in (errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENOTEMPTY):
        return FailedPrecondition(f"{reason}; something of another kind is in the way")
    if code in (errno.ENAMETOOLONG, errno.ELOOP):
        return InvalidArgument(f"{reason}; use a shorter path without symlink loops")
    if code == errno.EROFS:
        return FailedPrecondition(f"{reason}; that filesystem is mounted read-only")
    return CkptdError(f"{reason}; see the daemon log")


def cli_line(exc: CkptdError) -> str:
    """How the CLI prints an error: one line, no traceback, no credential."""
    from .redact import redact

    return redact(f"ckptd: error: {exc}")
