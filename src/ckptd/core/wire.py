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
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from ckptd.proto import PROTOCOL_HEADER, PROTOCOL_VERSION
from ckptd.proto import ckptd_pb2 as pb
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
Metadata = tuple[tuple[str, str], ...]
"""Extra gRPC metadata of one call (the liveness header of a lease request)."""
R = TypeVar("R", bound=Message)


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
    """A channel to one daemon, with one typed method per RPC (``get_status(request)``).

    Every call carries the protocol header; gRPC errors come back as the
    :class:`CkptdError` subclass of the daemon's domain error, with its message.
    """

    def __init__(
        self, socket: str | os.PathLike[str] | None = None, timeout: float = 120.0
    ) -> None:
        self.socket = socket_path(socket)
        self.timeout = timeout
        self.reached = False
        """Whether a daemon has ever answered a call on this connection: a client that
        never reached one fails fast instead of waiting out its reconnect patience."""
        self._channel = grpc.insecure_channel(
            f"unix:{self.socket}", options=CHANNEL_OPTIONS + RECONNECT_OPTIONS
        )
        self._stub = pb_grpc.CkptdStub(self._channel)
        self.session = Session(self.socket)

    def acquire_lease(
        self, request: pb.AcquireLeaseRequest, timeout: float | None = None, metadata: Metadata = ()
    ) -> pb.Lease:
        """A lease of staging memory (the save path's first call)."""
        return self._unary("AcquireLease", request, pb.Lease, timeout, metadata)

    def release_lease(
        self, request: pb.ReleaseLeaseRequest, timeout: float | None = None, metadata: Metadata = ()
    ) -> pb.ReleaseLeaseResponse:
        """Give a lease back, or tell the daemon this process holds a restored segment."""
        return self._unary("ReleaseLease", request, pb.ReleaseLeaseResponse, timeout, metadata)

    def commit_shards(
        self, request: pb.CommitShardsRequest, timeout: float | None = None, metadata: Metadata = ()
    ) -> pb.CommitShardsResponse:
        """Hand the shards in a lease to the daemon (the save path's second call)."""
        return self._unary("CommitShards", request, pb.CommitShardsResponse, timeout, metadata)

    def get_save_status(
        self,
        request: pb.GetSaveStatusRequest,
        timeout: float | None = None,
        metadata: Metadata = (),
    ) -> pb.SaveStatus:
        """A save's state, waiting server-side up to the request's timeout."""
        return self._unary("GetSaveStatus", request, pb.SaveStatus, timeout, metadata)

    def list_checkpoints(
        self,
        request: pb.ListCheckpointsRequest,
        timeout: float | None = None,
        metadata: Metadata = (),
    ) -> pb.ListCheckpointsResponse:
        """The checkpoints of a job (every job's with an empty name) and its history."""
        return self._unary(
            "ListCheckpoints", request, pb.ListCheckpointsResponse, timeout, metadata
        )

    def restore(
        self, request: pb.RestoreRequest, timeout: float | None = None, metadata: Metadata = ()
    ) -> pb.RestoreResponse:
        """Where a verified step lies: a lease of filled memory or a directory."""
        return self._unary("Restore", request, pb.RestoreResponse, timeout, metadata)

    def report_corrupt(
        self,
        request: pb.ReportCorruptRequest,
        timeout: float | None = None,
        metadata: Metadata = (),
    ) -> pb.ReportCorruptResponse:
        """Report a copy that failed its checksum here, so the daemon sets it aside."""
        return self._unary("ReportCorrupt", request, pb.ReportCorruptResponse, timeout, metadata)

    def get_status(
        self, request: pb.GetStatusRequest, timeout: float | None = None, metadata: Metadata = ()
    ) -> pb.DaemonStatus:
        """The daemon's status (tiers, memory, peers)."""
        return self._unary("GetStatus", request, pb.DaemonStatus, timeout, metadata)

    def pin(
        self, request: pb.PinRequest, timeout: float | None = None, metadata: Metadata = ()
    ) -> pb.PinResponse:
        """Pin or unpin a step."""
        return self._unary("Pin", request, pb.PinResponse, timeout, metadata)

    def set_retention(
        self,
        request: pb.SetRetentionRequest,
        timeout: float | None = None,
        metadata: Metadata = (),
    ) -> pb.SetRetentionResponse:
        """Set (or clear) a job's own retention policy."""
        return self._unary("SetRetention", request, pb.SetRetentionResponse, timeout, metadata)

    def check_capacity(
        self,
        request: pb.CheckCapacityRequest,
        timeout: float | None = None,
        metadata: Metadata = (),
    ) -> pb.Capacity:
        """Whether a save of the given size would find room now."""
        return self._unary("CheckCapacity", request, pb.Capacity, timeout, metadata)

    def fetch_peers(
        self, request: pb.FetchPeersRequest, timeout: float | None = None, metadata: Metadata = ()
    ) -> pb.FetchPeersResponse:
        """Other nodes' parts of a step, fetched into the local tier."""
        return self._unary("FetchPeers", request, pb.FetchPeersResponse, timeout, metadata)

    def adopt(
        self, request: pb.AdoptRequest, timeout: float | None = None, metadata: Metadata = ()
    ) -> pb.AdoptResponse:
        """Adopt a finished checkpoint directory another framework wrote."""
        return self._unary("Adopt", request, pb.AdoptResponse, timeout, metadata)

    def watch(
        self, request: pb.WatchRequest, timeout: float | None = None, metadata: Metadata = ()
    ) -> pb.WatchResponse:
        """Adopt every finished step a directory gets from now on."""
        return self._unary("Watch", request, pb.WatchResponse, timeout, metadata)

    def ensure_local(
        self, request: pb.EnsureLocalRequest, timeout: float | None = None, metadata: Metadata = ()
    ) -> pb.EnsureLocalResponse:
        """Bring an adopted step into the local tier; its directory."""
        return self._unary("EnsureLocal", request, pb.EnsureLocalResponse, timeout, metadata)

    def prefetch(
        self, request: pb.PrefetchRequest, timeout: float | None = None, metadata: Metadata = ()
    ) -> pb.PrefetchResponse:
        """Bring a job's newest restorable step into the local tier."""
        return self._unary("Prefetch", request, pb.PrefetchResponse, timeout, metadata)

    def list_events(
        self, request: pb.ListEventsRequest, timeout: float | None = None, metadata: Metadata = ()
    ) -> pb.ListEventsResponse:
        """The daemon's event log, waiting for new events as asked."""
        return self._unary("ListEvents", request, pb.ListEventsResponse, timeout, metadata)

    def call_by_name(
        self, method: str, request: Message, timeout: float | None = None, metadata: Metadata = ()
    ) -> Message:
        """Call RPC ``method`` (``"GetStatus"``) by name, for tools that go over every
        RPC (a fuzzer); code that knows its RPC uses the typed method instead."""
        return self._unary(method, request, Message, timeout, metadata)

    def _unary(
        self,
        method: str,
        request: Message,
        response: type[R],
        timeout: float | None,
        metadata: Metadata,
    ) -> R:
        """Make one call and return its response, checked to be of type ``response``.

        Every call carries this process's session token; a daemon that restarted
        does not know it, so the session is opened again and the call repeated once.
        """
        for attempt in (0, 1):
            session = self.session.metadata()
            try:
                answer = getattr(self._stub, method)(
                    request, timeout=timeout or self.timeout, metadata=METADATA + session + metadata
                )
            except grpc.RpcError as exc:
                error = error_from_rpc(exc, self.socket)
            else:
                self.reached = True
                if not isinstance(answer, response):
                    raise TypeError(f"{method} answered a {type(answer).__name__}")
                return answer
            if isinstance(error, Unavailable):
                self.session.reset()  # a daemon that comes back issues new sessions
            else:
                self.reached = True  # it answered, if only with an error
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
