"""Plumbing shared by the client and the CLI: the channel, RPC calls with the
protocol header, save handles and the checkpoint listing type."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from ckptd.proto import PROTOCOL_HEADER, PROTOCOL_VERSION, state_name
from ckptd.proto import ckptd_pb2 as pb

from .errors import CkptdError, CkptdUnavailable, SaveFailed, from_rpc_error

if TYPE_CHECKING:
    from .client import Client

DEFAULT_SOCKET = "/run/ckptd/ckptd.sock"
STAGES = {"local": pb.SAVE_STATE_LOCAL, "durable": pb.SAVE_STATE_DURABLE}
T = TypeVar("T")


def open_channel(socket: str) -> grpc.Channel:
    """A gRPC channel to the daemon's unix socket."""
    return grpc.insecure_channel(
        f"unix:{socket}",
        options=[
            ("grpc.max_receive_message_length", 256 * 2**20),
            ("grpc.max_send_message_length", 256 * 2**20),
        ],
    )


def rpc_call(method: Callable[..., T], request: Any, timeout: float, socket: str) -> T:
    """Call one RPC with the protocol header; gRPC errors become :class:`CkptdError`."""
    try:
        return method(
            request, timeout=timeout, metadata=((PROTOCOL_HEADER, str(PROTOCOL_VERSION)),)
        )
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, socket) from None


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint as the daemon lists it."""

    job: str
    step: int
    state: str
    tiers: tuple[str, ...]
    created_unix: float
    size_bytes: int
    num_shards: int
    milestone: bool
    error: str
    local_reasons: tuple[str, ...] = ()
    """Why the local tier keeps it: policy reasons ("latest", "every-10-steps", ...)
    or holds ("newest", "pinned", "awaiting-upload", "in-use")."""
    remote_reasons: tuple[str, ...] = ()
    pinned: bool = False
    metrics: dict[str, float] | None = None


class SaveHandle:
    """Returned by :meth:`Client.save`: the bytes are the daemon's; wait for a stage."""

    def __init__(self, client: Client, step: int) -> None:
        self.client = client
        self.job = client.job
        self.step = step

    def state(self) -> str:
        """Current state: STAGING, LOCAL, DRAINING, DURABLE or FAILED."""
        return state_name(self._status(pb.SAVE_STATE_UNSPECIFIED, 0.0).state)

    def wait(self, stage: str = "local", timeout: float | None = None) -> None:
        """Block until the save reaches ``stage`` ("local" or "durable").

        Raises :class:`SaveFailed` with the daemon's reason if the save failed,
        and ``TimeoutError`` if ``timeout`` seconds pass first. Rides out a
        daemon restart (the commit survives it once acknowledged and written).
        """
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {sorted(STAGES)}, not {stage!r}")
        target = STAGES[stage]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 60.0 if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                st = self._status(target, min(left, 60.0))
            except CkptdUnavailable:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
                continue
            if st.reached:
                return
            if st.final:
                raise SaveFailed(
                    f"step {self.step} of job {self.job!r} will not become {stage.upper()}: "
                    f"{state_name(st.state)}: {st.error}",
                    state_name(st.state),
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"step {self.step} of job {self.job!r} is {state_name(st.state)}, not "
                    f"{stage.upper()}, after {timeout} s"
                )

    def _status(self, target: int, timeout: float) -> pb.SaveStatus:
        req = pb.GetSaveStatusRequest(
            job=self.job,
            step=self.step,
            wait_for=target,  # type: ignore[arg-type]
            timeout_seconds=timeout,
        )
        status: pb.SaveStatus = self.client._call(
            self.client._stub.GetSaveStatus, req, timeout + 30.0
        )
        return status

    def __repr__(self) -> str:
        return f"SaveHandle(job={self.job!r}, step={self.step})"


def watch_stage(handle: SaveHandle, stage: str, done: threading.Event) -> None:
    """Wait (server-side, in bounded calls) until a save reaches ``stage`` or ends."""
    try:
        while True:
            st = handle._status(STAGES[stage], 30.0)
            if st.reached or st.final:
                return
    except CkptdError:
        return  # gone or unreachable: let the next save() report it
    finally:
        done.set()
