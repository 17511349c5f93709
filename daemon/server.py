"""The gRPC servicer (thin): the wire API on top of the daemon's domain objects.

It checks the protocol version, converts protobuf to domain calls on
:class:`~ckptd.daemon.node.Node` (and the restorer, drain and evictor) and maps
domain errors to gRPC statuses in one place. The process lifecycle is in
lifecycle.py.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from ckptd.client.format import ALIGN
from ckptd.proto import PROTOCOL_HEADER, PROTOCOL_VERSION, state_name
from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import ckptd_pb2_grpc as pb_grpc

from . import __version__
from .adopt import Adopter
from .drain import Drain
from .errors import CkptdError, FailedPrecondition, InvalidArgument
from .evict_plan import Plan
from .evictor import Evictor
from .layout import pin_key
from .names import check_name, check_step
from .node import Node, StepState
from .remote import Remote
from .requests import parse_commit
from .restore import Restorer
from .staging import Lease

log = logging.getLogger("ckptd.server")

R = TypeVar("R")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]


def _rpc(fn: Handler[R]) -> Handler[R]:
    @functools.wraps(fn)
    async def wrapper(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            _check_protocol(context)
            return await fn(self, request, context)
        except CkptdError as exc:
            await context.abort(exc.code, str(exc))
        except Exception as exc:
            log.exception("%s failed", fn.__name__)
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"internal error in {fn.__name__}: {exc!r}; see the daemon log",
            )
        raise AssertionError("unreachable: abort raises")

    return wrapper


def _check_protocol(context: grpc.aio.ServicerContext) -> None:
    sent = dict(context.invocation_metadata() or ()).get(PROTOCOL_HEADER)
    if sent is None:
        raise FailedPrecondition(
            f"the client sent no {PROTOCOL_HEADER} header; use ckptd.client.Client of a "
            f"release speaking protocol {PROTOCOL_VERSION}"
        )
    if str(sent) != str(PROTOCOL_VERSION):
        raise FailedPrecondition(
            f"client speaks ckptd protocol {sent} but this daemon speaks {PROTOCOL_VERSION}; "
            "install matching ckptd versions for the trainer and the daemon"
        )


def _tiers(st: StepState) -> list[pb.Tier]:
    tiers = [pb.TIER_LOCAL] if st.manifest is not None else []
    return tiers + ([pb.TIER_REMOTE] if st.in_remote else [])


def _checkpoint_info(st: StepState, plan: Plan | None) -> pb.CheckpointInfo:
    m = st.manifest
    return pb.CheckpointInfo(
        local_reasons=plan.local_reasons.get(st.step, []) if plan else [],
        remote_reasons=plan.remote_reasons.get(st.step, []) if plan else [],
        pinned=st.pinned,
        metrics=st.metrics,
        adopted=st.adopted,
        source=m.source if m else "",
        job=st.job,
        step=st.step,
        state=st.state,  # type: ignore[arg-type]
        tiers=_tiers(st),
        created_unix=m.created_unix if m else st.handoff_at,
        size_bytes=m.size_bytes if m else 0,
        num_shards=len(m.shards) if m else 0,
        milestone=st.milestone,
        error=st.error,
    )


def _lease_message(lease: Lease) -> pb.Lease:
    return pb.Lease(
        lease_id=lease.lease_id,
        segment=lease.segment.name,
        size_bytes=lease.segment.size,
        alignment=ALIGN,
    )


class Servicer(pb_grpc.CkptdServicer):
    """gRPC front of a :class:`Node`."""

    def __init__(
        self,
        node: Node,
        remote: Remote | None = None,
        drain: Drain | None = None,
        evictor: Evictor | None = None,
        adopter: Adopter | None = None,
    ) -> None:
        self.node = node
        self.drain = drain
        self.remote = remote
        self.evictor = evictor or Evictor(node, remote)
        self.restorer = Restorer(node, remote)
        self.adopter = adopter or Adopter(node)

    @_rpc
    async def AcquireLease(self, request: pb.AcquireLeaseRequest, context: Any) -> pb.Lease:
        job = check_name("job", request.job)
        self.node.staging.check_fits(request.size_bytes)
        await self.evictor.check_space(request.size_bytes)
        lease = await self.node.acquire_lease(job, request.size_bytes, request.wait_seconds)
        return _lease_message(lease)

    @_rpc
    async def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context: Any
    ) -> pb.ReleaseLeaseResponse:
        if request.client_holds:
            self.restorer.lend(request.lease_id)
        else:
            self.node.release_lease(request.lease_id)
        return pb.ReleaseLeaseResponse()

    @_rpc
    async def CommitShards(
        self, request: pb.CommitShardsRequest, context: Any
    ) -> pb.CommitShardsResponse:
        state = self.node.commit(parse_commit(request))
        return pb.CommitShardsResponse(state=state)  # type: ignore[arg-type]

    @_rpc
    async def GetSaveStatus(self, request: pb.GetSaveStatusRequest, context: Any) -> pb.SaveStatus:
        job, step = check_name("job", request.job), check_step(request.step)
        st = await self.node.wait(job, step, request.wait_for, request.timeout_seconds)
        return pb.SaveStatus(
            job=st.job,
            step=st.step,
            state=st.state,  # type: ignore[arg-type]
            error=st.error,
            ranks_committed=sorted(st.ranks) if st.manifest is None else list(st.node_ranks),
            node_ranks=list(st.node_ranks),
            handoff_to_local_seconds=max(0.0, st.local_at - st.handoff_at) if st.local_at else 0.0,
            handoff_to_durable_seconds=(
                max(0.0, st.durable_at - st.handoff_at) if st.durable_at else 0.0
            ),
            reached=st.reached(request.wait_for) if request.wait_for else False,
            final=st.final(request.wait_for) if request.wait_for else False,
            tiers=_tiers(st),
        )

    @_rpc
    async def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: Any
    ) -> pb.ListCheckpointsResponse:
        job = check_name("job", request.job) if request.job else ""
        rows = self.node.list(job)
        plans = {j: self.evictor.plan(j) for j in {s.job for s in rows}}
        return pb.ListCheckpointsResponse(
            checkpoints=[_checkpoint_info(s, plans[s.job]) for s in rows]
        )

    @_rpc
    async def Restore(self, request: pb.RestoreRequest, context: Any) -> pb.RestoreResponse:
        job = check_name("job", request.job)
        step = check_step(request.step) if request.HasField("step") else None
        plan = await self.restorer.restore(job, step, request.rank, request.shared_memory)
        plan.step.read_at = time.monotonic()  # the client opens the files next: keep them
        resp = pb.RestoreResponse(
            job=job,
            step=plan.step.step,
            tier=pb.TIER_LOCAL,
            directory=str(plan.directory),
            manifest_json=plan.manifest.to_json(),
        )
        if plan.lease is not None:
            resp.lease.CopyFrom(_lease_message(plan.lease))
            resp.data_offset_in_file = plan.data_offset
        return resp

    @_rpc
    async def ReportCorrupt(
        self, request: pb.ReportCorruptRequest, context: Any
    ) -> pb.ReportCorruptResponse:
        job, step = check_name("job", request.job), check_step(request.step)
        if request.tier not in (pb.TIER_LOCAL, pb.TIER_UNSPECIFIED):
            raise InvalidArgument("only local copies can be reported corrupt in this version")
        await self.restorer.report_corrupt(job, step, request.detail)
        return pb.ReportCorruptResponse()

    @_rpc
    async def Pin(self, request: pb.PinRequest, context: Any) -> pb.PinResponse:
        job, step = check_name("job", request.job), check_step(request.step)
        st = self.node.get_step(job, step)
        if st.manifest is None and not st.in_remote:
            raise FailedPrecondition(
                f"step {step} of job {job!r} has no complete copy to pin ({state_name(st.state)})"
            )
        if self.remote is not None:
            key = pin_key(job, step, st.adopted)
            if request.pinned:
                await self.remote.put_bytes(key, b"pinned by ckptd pin\n")
            else:
                await self.remote.delete([key])
        st.pinned = request.pinned
        await self.node.save_pins()
        log.info("%s/%d %s", job, step, "pinned" if request.pinned else "unpinned")
        self.evictor.kick()
        return pb.PinResponse()

    @_rpc
    async def CheckCapacity(self, request: pb.CheckCapacityRequest, context: Any) -> pb.Capacity:
        check_name("job", request.job)
        reason = self.evictor.capacity_reason(request.size_bytes)
        staging = self.node.staging
        return pb.Capacity(
            ok=not reason,
            reason=reason,
            staging_free_bytes=max(0, staging.budget_bytes - staging.in_use_bytes),
            local_free_bytes=self.evictor.space().free,
        )

    @_rpc
    async def FetchPeers(
        self, request: pb.FetchPeersRequest, context: Any
    ) -> pb.FetchPeersResponse:
        job, step = check_name("job", request.job), check_step(request.step)
        parts = await self.restorer.fetch_peers(job, step)
        return pb.FetchPeersResponse(
            parts=[pb.PeerPart(node=n, directory=str(d), manifest_json=m) for n, d, m in parts]
        )

    @_rpc
    async def GetStatus(self, request: pb.GetStatusRequest, context: Any) -> pb.DaemonStatus:
        node, cfg = self.node, self.node.config
        st = os.statvfs(cfg.root)
        low, floor = self.evictor.marks()
        manifests = [s.manifest for s in node.steps.values() if s.manifest is not None]
        return pb.DaemonStatus(
            version=__version__,
            protocol_version=PROTOCOL_VERSION,
            node_id=cfg.node_id,
            root=str(cfg.root),
            socket=str(cfg.socket),
            remote=cfg.remote,
            drain_queue=self.drain.queue_length if self.drain else 0,
            drain_error=self.drain.last_error if self.drain else "",
            uptime_seconds=time.time() - node.started_at,
            staging_budget_bytes=node.staging.budget_bytes,
            staging_allocated_bytes=node.staging.allocated_bytes,
            staging_in_use_bytes=node.staging.in_use_bytes,
            leases_held=node.staging.leases_held,
            saves_in_flight=sum(1 for s in node.steps.values() if s.state == pb.SAVE_STATE_STAGING),
            local_free_bytes=st.f_bavail * st.f_frsize,
            local_used_bytes=sum(m.size_bytes for m in manifests),
            jobs=len({s.job for s in node.steps.values()}),
            checkpoints=len(manifests),
            pid=os.getpid(),
            retention_local=self.evictor.local_policy.describe(),
            retention_remote=(
                self.evictor.remote_policy.describe() if self.evictor.remote_policy else ""
            ),
            local_low_watermark_bytes=low,
            local_floor_bytes=floor,
            evicted_local=self.evictor.evicted_local,
            evicted_remote=self.evictor.evicted_remote,
            watched_directories=len(self.adopter.watches),
            adopted=self.adopter.adopted,
        )

    @_rpc
    async def Adopt(self, request: pb.AdoptRequest, context: Any) -> pb.AdoptResponse:
        job, step = check_name("job", request.job), check_step(request.step)
        if not request.path:
            raise InvalidArgument("no path given; name the finished directory to adopt")
        st = await self.adopter.adopt(
            job,
            step,
            Path(request.path),
            metrics=dict(request.metrics),
            milestone=request.milestone,
        )
        assert st.manifest is not None
        return pb.AdoptResponse(
            state=st.state,  # type: ignore[arg-type]
            files=len(st.manifest.ranks),
            size_bytes=st.manifest.size_bytes,
        )

    @_rpc
    async def Watch(self, request: pb.WatchRequest, context: Any) -> pb.WatchResponse:
        job = check_name("job", request.job)
        path = await self.adopter.watch(job, request.directory)
        remote = f"{self.remote.url}/{job}" if self.remote is not None else ""
        return pb.WatchResponse(directory=str(path), remote_directory=remote)

    @_rpc
    async def EnsureLocal(
        self, request: pb.EnsureLocalRequest, context: Any
    ) -> pb.EnsureLocalResponse:
        job = check_name("job", request.job)
        step = check_step(request.step) if request.HasField("step") else None
        if request.directory and not Path(request.directory).is_absolute():
            raise InvalidArgument(f"{request.directory!r} is not an absolute path")
        await self.restorer.refresh_remote(job)
        st = self.restorer.choose(job, step, None, adopted=True)
        st.read_at = time.monotonic()  # the evictor leaves it alone while it is put back
        fetched = st.manifest is None
        if fetched:
            await self.restorer.fetch_to_local(st, 0, shared_memory=False)
        path, linked = await self.adopter.ensure_local(
            job, st, request.directory, verify=not fetched
        )
        return pb.EnsureLocalResponse(step=st.step, path=str(path), fetched=fetched, linked=linked)
