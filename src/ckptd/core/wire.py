"""The connection to a daemon: the socket, the channel, calls with the protocol header.

Shared by the trainer's client, its framework adapters and the ``ckptd`` CLI, so
each speaks to the daemon the same way and gets the same errors
(:mod:`ckptd.core.errors`).
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Mapping
from typing import Any

import grpc

from ckptd.proto import PROTOCOL_HEADER, PROTOCOL_VERSION
from ckptd.proto import ckptd_pb2_grpc as pb_grpc

from .errors import CkptdError, Unauthenticated, Unavailable, from_status
from .session import Session

DEFAULT_SOCKET = "/run/ckptd/ckptd.sock"
"""Where ``ckptd serve`` listens unless configured otherwise (one default for both sides)."""
MAX_MESSAGE_BYTES = 256 * 2**20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
RECONNECT_OPTIONS = [
    # A restarted daemon is back within seconds: retry the socket every 0.1-1 s
    # instead of gRPC's default backoff (up to 120 s), so a trainer resumes at once.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
METADATA = ((PROTOCOL_HEADER, str(PROTOCOL_VERSION)),)
"""Sent with every call: the daemon refuses a client of another protocol version."""


def socket_path(socket: str | os.PathLike[str] | None = None) -> str:
    """The socket to use: the one given, else ``$CKPTD_SOCKET``, else the default."""
    if not socket and not os.environ.get("CKPTD_SOCKET"):
        _warn_misspelt_socket_variable(os.environ)
    return os.fspath(socket or os.environ.get("CKPTD_SOCKET") or DEFAULT_SOCKET)


_warned_socket_variables: set[str] = set()


def _warn_misspelt_socket_variable(env: Mapping[str, str]) -> None:
    """Warn (once per name) about a ``CKPTD_*`` variable that looks like a misspelt
    ``CKPTD_SOCKET``: the client would otherwise go to the default socket without a
    word. Other ``CKPTD_*`` names are the daemon's settings, often set beside it."""
    for name in difflib.get_close_matches(
        "CKPTD_SOCKET", [k for k in env if k.startswith("CKPTD_")], n=3, cutoff=0.85
    ):
        if name not in _warned_socket_variables:
            _warned_socket_variables.add(name)
            warnings.warn(
                f"environment variable {name} is not read by ckptd; did you mean "
                f"CKPTD_SOCKET? (using the default socket {DEFAULT_SOCKET})",
                stacklevel=3,
            )


def error_from_rpc(exc: grpc.RpcError, socket: str) -> CkptdError:
    """Convert a gRPC error into the matching :class:`CkptdError`."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE and "ckptd" not in (details or ""):
        details = (
            f"cannot reach the ckptd daemon at {socket}: is `ckptd serve` running there? "
            f"(set CKPTD_SOCKET or pass socket=...; gRPC said: {details})"
        )
    return from_status(code, details or "")


class Connection:
    """A channel to one daemon; ``call("Restore", request)`` makes one RPC.

    Every call carries the protocol header; gRPC errors come back as the
    :class:`CkptdError` subclass of the daemon's domain error, with its message.
    """

    def __init__(self, socket: str | os.PathLike[str] | None = None, timeout: float = 120.0):
        self.socket = socket_path(socket)
        self.timeout = timeout
        self._channel = grpc.insecure_channel(
            f"unix:{self.socket}", options=CHANNEL_OPTIONS + RECONNECT_OPTIONS
        )
        self._stub = pb_grpc.CkptdStub(self._channel)
        self.session = Session(self.socket)

    def call(
        self,
        method: str,
        request: Any,
        timeout: float | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Any:
        """Call RPC ``method`` (``"GetStatus"``...) and return its response message.

        Every call carries this process's session token; a daemon that restarted
        does not know it, so the session is opened again and the call repeated once.
        """
        for attempt in (0, 1):
            session = self.session.metadata()
            try:
                return getattr(self._stub, method)(
                    request, timeout=timeout or self.timeout, metadata=METADATA + session + metadata
                )
            except grpc.RpcError as exc:
                error = error_from_rpc(exc, self.socket)
            if isinstance(error, Unavailable):
                self.session.reset()  # a daemon that comes back issues new sessions
            if not (isinstance(error, Unauthenticated) and attempt == 0):
                raise error
            self.session.reset()
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the channel and end the session."""
        self._channel.close()
        self.session.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
