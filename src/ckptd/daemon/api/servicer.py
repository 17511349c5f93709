"""The gRPC servicer: the wire API over the daemon's services, and nothing more.

Each RPC checks the protocol version, validates its request (names, steps,
fields: :mod:`ckptd.core.names`, requests.py), calls one service and converts
the result (messages.py). Domain errors become gRPC statuses in one place
(:func:`_rpc`, by :mod:`ckptd.core.errors`); anything else is a bug, logged with
its traceback and returned as INTERNAL. The services are built once by the
composition root (app/compose.py).

Every call names its session (sessions.py): the kernel-verified uid and pid of
the caller. Job-scoped calls pass :meth:`Access.check_job` first; leases are
granted to, and only usable by, the calling process (access.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from ckptd.core.errors import (
    CkptdError,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
    from_os_error,
)
from ckptd.core.names import check_name, check_step, check_wait
from ckptd.core.redact import redact
from ckptd.core.session import SESSION_HEADER
from ckptd.proto import PROTOCOL_HEADER, PROTOCOL_VERSION
from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import ckptd_pb2_grpc as pb_grpc

from ..adopt.adopter import Adopter
from ..catalog import MAX_WAIT_SECONDS, Catalog
from ..lifecycle.pins import Pins
from ..local.admission import Admission
from ..local.liveness import HOLDER_HEADER
from ..local.records import INLINE_SHARDS
from ..local.saver import Saver
from ..local.staging import Staging
from ..restore.restorer import Restorer
from ..retention.planner import Retention
from . import messages
from .access import Access
from .history import JobHistory
from .requests import CommitParser, check_metrics
from .sessions import Peer, SessionServer

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
            if exc.status == grpc.StatusCode.INTERNAL:  # not the caller's doing (a bucket error)
                log.exception("%s failed", fn.__name__)
            await context.abort(exc.status, str(exc))
        except OSError as exc:
            # A full disk or a path outside ckptd is not a bug; anything else is.
            error = from_os_error(exc, f"{fn.__name__} failed")
            if error.status == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", fn.__name__)
            await context.abort(error.status, redact(str(error)))
        except Exception as exc:
            log.exception("%s failed", fn.__name__)
            await context.abort(
                grpc.StatusCode.INTERNAL,
                redact(f"internal error in {fn.__name__}: {exc!r}; see the daemon log"),
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


@dataclass(frozen=True)
class Services:
    """What the API calls; built once by the composition root."""

    catalog: Catalog
    saver: Saver
    staging: Staging
    """The lease pool: who holds what, what fits, what a restored trainer keeps."""
    admission: Admission
    retention: Retention
    restorer: Restorer
    adopter: Adopter
    pins: Pins
    access: Access
    remote_url: str
    status: Callable[[], pb.DaemonStatus]
    restored: Callable[[str], None]
    """Counts a Restore answered, by the tier its copy came from (the metrics)."""
    history: JobHistory
    """Each job's restarts, for Goodput()'s learned failure rate (history.py)."""
    paced: Callable[[str, float], None]
    """Sets a job's upload pace, as its commits ask (lifecycle/pace.py)."""
    evict: Callable[[], None]
    """Wakes the evictor: a job's retention changed."""


class Servicer(pb_grpc.CkptdServicer):
    """gRPC front of the daemon's services."""

    def __init__(self, services: Services, sessions: SessionServer) -> None:
        self.s = services
        self.sessions = sessions
        self.parser = CommitParser()
        self.history = services.history

    def _peer(self, context: Any) -> Peer:
        """The caller, from its session token (UNAUTHENTICATED without a live one)."""
        token = str(dict(context.invocation_metadata() or ()).get(SESSION_HEADER, ""))
        peer = self.sessions.peer(token) if token else None
        if peer is None:
            raise Unauthenticated(
                f"the call carried no live ckptd session ({SESSION_HEADER} metadata); use "
                "ckptd.client of this release, which opens one on the daemon's session socket "
                f"({self.sessions.path}) and opens a new one after a daemon restart"
            )
        return peer

    def _job(self, context: Any, name: str) -> tuple[Peer, str]:
        """The caller and a validated job name it may use."""
        peer, job = self._peer(context), check_name("job", name)
        self.s.access.check_job(peer, job)
        return peer, job

    def _own_lease(self, peer: Peer, lease_id: str) -> None:
        lease = self.s.staging.get(lease_id)
        # A lease replayed from the journal is nobody's: it is committed already, and
        # the saver answers a retried commit of it with a conflict.
        if lease.owner not in (None, peer.process) and not self.s.access.privileged(peer):
            raise PermissionDenied(
                f"lease {lease_id[:40]!r} was granted to another process; acquire your own"
            )

    @_rpc
    async def AcquireLease(self, request: pb.AcquireLeaseRequest, context: Any) -> pb.Lease:
        peer, job = self._job(context, request.job)
        await self.s.restorer.read_own_index(job)  # a rerun after a node loss: a new timeline
        self.s.retention.jobs.look_up(job)  # its own retention, read before a step is pending
        with self.s.access.claiming(peer, job):  # owned only once a lease is granted
            self.s.staging.check_fits(request.size_bytes)
            await self.s.admission.check_space(request.size_bytes)
            holder = str(dict(context.invocation_metadata() or ()).get(HOLDER_HEADER, ""))
            image = (job, request.rank) if request.reuse_image else None
            lease = await self.s.saver.acquire_lease(
                job, request.size_bytes, request.wait_seconds, holder, peer.process, image,
                request.reserve,
            )  # fmt: skip
        self.history.seen(job)
        return messages.lease(lease)

    @_rpc
    async def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context: Any
    ) -> pb.ReleaseLeaseResponse:
        self._own_lease(self._peer(context), request.lease_id)
        if request.client_holds:
            self.s.staging.lend(request.lease_id)  # the trainer maps it: its memory now
        else:
            self.s.saver.release_lease(request.lease_id)
        return pb.ReleaseLeaseResponse()

    @_rpc
    async def CommitShards(
        self, request: pb.CommitShardsRequest, context: Any
    ) -> pb.CommitShardsResponse:
        peer, job = self._job(context, request.job)
        self._own_lease(peer, request.lease_id)
        # Whom the write (and a replay) waits for while it copies: the lease's client,
        # whatever the request says (local/copied.py).
        copying = bool(request.copied_nonce)
        request.copied_holder = self.s.staging.get(request.lease_id).holder if copying else ""
        request.copied_pid = peer.pid if copying and peer.started else 0
        request.copied_started = (peer.started or 0) if copying else 0
        # Thousands of shards: their table is checked with array operations, but the
        # tree spec is parsed per leaf (and older clients send a message per shard):
        # on a thread, so the loop keeps answering other ranks meanwhile. The same
        # structure as the rank's last commit (every step of a training loop) was
        # checked then, and is not again.
        count = max(len(request.shards), len(request.table.keys))
        known = self.parser.known(request)
        parsed = (
            self.parser.parse(request, known)
            if count <= INLINE_SHARDS or (known[0] is not None and known[1] is not None)
            else await asyncio.to_thread(self.parser.parse, request, known)
        )
        # The request itself is journaled: a restarted daemon replays it as received.
        with self.s.access.claiming(peer, job):  # a no-op for a job its lease claimed
            state = await self.s.saver.commit(parsed, request.SerializeToString())
        self.s.paced(job, request.upload_interval_seconds)
        return pb.CommitShardsResponse(state=state)  # type: ignore[arg-type]

    @_rpc
    async def GetSaveStatus(self, request: pb.GetSaveStatusRequest, context: Any) -> pb.SaveStatus:
        _, job = self._job(context, request.job)
        step = check_step(request.step)
        if request.wait_for == pb.SAVE_STATE_DURABLE and not self.s.remote_url:
            raise FailedPrecondition(
                "this daemon has no remote tier configured, so no save becomes DURABLE; "
                "wait('local') instead"
            )
        st = await self.s.catalog.wait(job, step, request.wait_for, request.timeout_seconds)
        return messages.save_status(st, request.wait_for, self.s.saver.ranks_written(st))

    @_rpc
    async def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: Any
    ) -> pb.ListCheckpointsResponse:
        peer = self._peer(context)
        job = self._job(context, request.job)[1] if request.job else ""
        if job:  # what the tiers hold of it (the bucket's index: read once in this life)
            await self.s.restorer.learn(job)
        rows = [s for s in self.s.catalog.list(job) if self.s.access.may_use(peer, s.job)]
        plans = {j: self.s.retention.plan(j) for j in {s.job for s in rows}}
        return pb.ListCheckpointsResponse(
            checkpoints=[messages.checkpoint_info(s, plans[s.job]) for s in rows],
            history=self.history.message(job) if job else None,
        )

    @_rpc
    async def Restore(self, request: pb.RestoreRequest, context: Any) -> pb.RestoreResponse:
        peer, job = self._job(context, request.job)
        step = check_step(request.step) if request.HasField("step") else None
        holder = str(dict(context.invocation_metadata() or ()).get(HOLDER_HEADER, ""))
        plan = await self.s.restorer.restore(
            job,
            step,
            request.rank,
            request.shared_memory,
            holder,
            peer.process,
            request.healthy,
            request.copy_on_write,
            functools.partial(self.s.access.may_use, peer),
        )
        try:  # the job's owner may have come with its copies (a node that lost its disk)
            self.s.access.check_job(peer, job)
        except PermissionDenied:
            if plan.lease is not None:
                self.s.staging.release(plan.lease.lease_id)
            raise
        self.s.restored(plan.tier)
        self.history.restored(job, request.rank, peer.process)
        for where in plan.reads:
            self.s.access.grant(peer, where)
        resp = pb.RestoreResponse(
            job=job,
            step=plan.step.step,
            tier=pb.TIER_MEMORY if plan.tier == "memory" else pb.TIER_LOCAL,
            directory=str(plan.directory),
            manifest_json=plan.manifest.to_json(),
            holder_directories={n: str(where) for n, where in plan.holder_dirs.items()},
        )
        if plan.lease is not None:
            resp.lease.CopyFrom(messages.lease(plan.lease))
            resp.data_offset_in_file = plan.data_offset
        return resp

    @_rpc
    async def ReportCorrupt(
        self, request: pb.ReportCorruptRequest, context: Any
    ) -> pb.ReportCorruptResponse:
        _, job = self._job(context, request.job)
        step = check_step(request.step)
        if request.tier not in (pb.TIER_LOCAL, pb.TIER_UNSPECIFIED):
            raise InvalidArgument("only local copies can be reported corrupt in this version")
        await self.s.restorer.report_corrupt(job, step, request.detail)
        return pb.ReportCorruptResponse()

    @_rpc
    async def Pin(self, request: pb.PinRequest, context: Any) -> pb.PinResponse:
        peer, job = self._job(context, request.job)
        with self.s.access.claiming(peer, job):
            await self.s.pins.set(job, check_step(request.step), request.pinned)
        return pb.PinResponse()

    @_rpc
    async def SetRetention(
        self, request: pb.SetRetentionRequest, context: Any
    ) -> pb.SetRetentionResponse:
        peer, job = self._job(context, request.job)
        await self.s.restorer.read_own_index(job)  # the job's owner, as a lease learns it
        retention = self.s.retention
        with self.s.access.claiming(peer, job):
            await retention.jobs.set_everywhere(job, request.policy)
        self.s.evict()
        local, remote = retention.jobs.tiers(job, retention.local_policy, retention.remote_policy)
        return pb.SetRetentionResponse(
            local=local.describe(), remote=remote.describe() if remote is not None else ""
        )

    @_rpc
    async def CheckCapacity(self, request: pb.CheckCapacityRequest, context: Any) -> pb.Capacity:
        self._job(context, request.job)
        reason = self.s.admission.capacity_reason(request.size_bytes)
        staging = self.s.staging
        return pb.Capacity(
            ok=not reason,
            reason=reason,
            staging_free_bytes=max(0, staging.budget_bytes - staging.in_use_bytes),
            local_free_bytes=self.s.admission.disk.space().free,
        )

    @_rpc
    async def FetchPeers(
        self, request: pb.FetchPeersRequest, context: Any
    ) -> pb.FetchPeersResponse:
        peer, job = self._job(context, request.job)
        parts = await self.s.restorer.other_parts(job, check_step(request.step))
        for part in parts:
            for directory in part.reads:
                self.s.access.grant(peer, directory)
        return pb.FetchPeersResponse(
            parts=[
                pb.PeerPart(node=p.node, directory=str(p.directory), manifest_json=p.manifest_json)
                for p in parts
            ]
        )

    @_rpc
    async def GetStatus(self, request: pb.GetStatusRequest, context: Any) -> pb.DaemonStatus:
        self._peer(context)
        return self.s.status()

    @_rpc
    async def Adopt(self, request: pb.AdoptRequest, context: Any) -> pb.AdoptResponse:
        peer, job = self._job(context, request.job)
        step = check_step(request.step)
        metrics = check_metrics(request.metrics)
        if not request.path:
            raise InvalidArgument("no path given; name the finished directory to adopt")
        with self.s.access.claiming(peer, job):
            st = await self.s.adopter.adopt(
                job,
                step,
                self.s.adopter.source(self.s.access.caller(peer), request.path),
                metrics=metrics,
                milestone=request.milestone,
                caller=self.s.access.caller(peer),
            )
        assert st.manifest is not None
        return pb.AdoptResponse(
            state=st.state,  # type: ignore[arg-type]
            files=len(st.manifest.ranks),
            size_bytes=st.manifest.size_bytes,
        )

    @_rpc
    async def Watch(self, request: pb.WatchRequest, context: Any) -> pb.WatchResponse:
        peer, job = self._job(context, request.job)
        with self.s.access.claiming(peer, job):
            path = await self.s.adopter.watch(
                job, request.directory, self.s.access.caller(peer), request.layout
            )
        remote = f"{self.s.remote_url}/{job}" if self.s.remote_url else ""
        return pb.WatchResponse(directory=str(path), remote_directory=remote)

    @_rpc
    async def EnsureLocal(
        self, request: pb.EnsureLocalRequest, context: Any
    ) -> pb.EnsureLocalResponse:
        peer, job = self._job(context, request.job)
        step = check_step(request.step) if request.HasField("step") else None
        with self.s.access.claiming(peer, job):
            st, path, fetched, linked = await self.s.adopter.ensure_local(
                job,
                step,
                request.directory,
                self.s.access.caller(peer),
                request.layout,
                functools.partial(self.s.access.may_use, peer),
            )
        return pb.EnsureLocalResponse(step=st.step, path=str(path), fetched=fetched, linked=linked)

    @_rpc
    async def Prefetch(self, request: pb.PrefetchRequest, context: Any) -> pb.PrefetchResponse:
        peer, job = self._job(context, request.job)
        st, source = await self.s.restorer.prefetch(
            job, functools.partial(self.s.access.may_use, peer)
        )
        assert st.manifest is not None
        return pb.PrefetchResponse(step=st.step, source=source, size_bytes=st.manifest.size_bytes)

    @_rpc
    async def ListEvents(
        self, request: pb.ListEventsRequest, context: Any
    ) -> pb.ListEventsResponse:
        peer = self._peer(context)
        job = self._job(context, request.job)[1] if request.job else ""
        catalog = self.s.catalog
        wait = check_wait("wait_seconds", request.wait_seconds, MAX_WAIT_SECONDS)
        if wait > 0 and not catalog.events(request.after_seq, job, 1):
            await catalog.wait_for_event(request.after_seq, job, wait)
        rows = [
            e
            for e in catalog.events(request.after_seq, job, request.limit or 2**31)
            if self.s.access.may_use(peer, e.job)
        ]
        return pb.ListEventsResponse(
            events=[messages.event(e) for e in rows], last_seq=catalog.last_seq
        )
