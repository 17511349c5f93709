"""Errors of the remote tier, and which of the libraries' errors are worth retrying."""

from __future__ import annotations

import errno

from ckptd.core.errors import CkptdError


class RemoteError(CkptdError):
    """A remote operation failed; ``transient`` says whether retrying may help."""

    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


CONNECTION_ERRORS = frozenset(
    {
        # aiohttp (gcsfs, s3fs through aiobotocore) and botocore
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ClientOSError",
        "ClientPayloadError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        # botocore's wrapper of an HTTP client failure (a reply it could not parse, a
        # connection closed mid-request): trouble on the wire, not the store's answer.
        "HTTPClientError",
    }
)
TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.EIO,
        errno.EREMOTEIO,  # s3fs's translation of a server-side S3 error (InternalError, 5xx)
        errno.EAGAIN,
    }
)


def transient_http_status(code: object) -> bool:
    """HTTP statuses worth retrying: 5xx, request timeout, too many requests."""
    text = str(code)
    return text.isascii() and text.isdigit() and (int(text) >= 500 or int(text) in (408, 429))
