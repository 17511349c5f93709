"""Retention set by a job's trainer: the framework's own knobs (Orbax ``max_to_keep``,
``best_fn`` and ``keep_period``; torchtitan ``keep_latest_k``; the HF Trainer's
``save_total_limit`` and best checkpoint) become the job's retention, so what the
framework lists is what exists.

A trainer sends its policy in the config's language (policies.py) with
``SetRetention``; from then on, for that job:

- **the durable tier keeps what the job's policy keeps**, milestones always: the
  bucket's policy with a remote tier, else the local one;
- **a local tier below a bucket keeps what both the node's local policy and the
  job's keep**: the operator's local budget still holds, and no step the job's
  policy let go stays behind on the disk;
- **within the operator's limits**: ``job_retention = false`` refuses every job
  policy, and ``job_retention_max_steps`` N (0: none) keeps at most the newest N
  of the steps a job's policy keeps (milestones and pins apart).

- **the operator's floor**: ``job_retention_floor`` (a policy) is kept of every job
  in its durable tier whatever the job's policy says;
- **an older run's abandoned timelines** keep what the node's policies or the job's
  keep: a new run's narrower policy never prunes them further.

The safety rules of plan.py hold as for the node's policies (the newest step, pins,
copies still being read, copies the bucket still needs). The policies are kept in
``<root>/job-retention.json`` (replaced whole, fsynced), so a daemon restarted under
a running trainer goes on with them, and in the bucket, one record per node
(``<job>/_retention/<node>.json``: a node reads only its own, which no other node's
user can write), so a replacement node's daemon (the same node name), which finds
the job's steps there, applies the job's policy to them, not its own, before any
trainer connects. Until a job's policy is known (:meth:`JobRetention.settled`: this
node's record read once), the bucket wants every step of it and the evictor removes
none of its bucket copies. Records a transient error left behind, and all of them
after a restart, are written at the evictor's next pass. A trainer sends its own
again at start-up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ckptd.core.errors import FailedPrecondition, InvalidArgument, NotFound

from ..files import read_small, replace_synced
from ..remote.layout import retention_key
from .policies import (
    Checkpoint,
    KeepAll,
    KeepAny,
    KeepMilestones,
    KeepSteps,
    Kept,
    Policy,
    PolicyError,
    parse_policy,
)

if TYPE_CHECKING:
    from ..remote.base import Remote

log = logging.getLogger("ckptd.retention")

FILE = "job-retention.json"
READ_TIMEOUT = 10.0
"""Longest wait for a job's bucket record (a store that hangs is asked again later)."""
MAX_TEXT = 4096
"""Longest policy text a trainer may send (a few dozen policies)."""


class Limits(Protocol):
    """The operator's limits on jobs' own policies (lifecycle/options.py's keys:
    lifecycle/ stands above retention/, so they are named here, not imported)."""

    @property
    def job_retention(self) -> bool: ...
    @property
    def job_retention_max_steps(self) -> int: ...
    @property
    def job_retention_floor(self) -> Policy: ...


@dataclass(frozen=True, repr=False)
class KeepBoth(Policy):
    """A step is kept if both policies keep it (their reasons merged)."""

    first: Policy
    second: Policy

    def keep(self, ckpts: Sequence[Checkpoint], now: float) -> Kept:
        a, b = self.first.keep(ckpts, now), self.second.keep(ckpts, now)
        return {step: reasons | b[step] for step, reasons in a.items() if step in b}

    def describe(self) -> str:
        return f"KeepBoth({self.first.describe()}, {self.second.describe()})"


@dataclass(frozen=True, repr=False)
class KeepAtMost(Policy):
    """Of the steps ``policy`` keeps, the newest ``n``."""

    policy: Policy
    n: int

    def keep(self, ckpts: Sequence[Checkpoint], now: float) -> Kept:
        kept = self.policy.keep(ckpts, now)
        return {s: kept[s] for s in sorted(kept, reverse=True)[: self.n]}

    def describe(self) -> str:
        return f"KeepAtMost({self.policy.describe()}, {self.n})"


class JobRetention:
    """The jobs' own policies, as their trainers set them (see the module)."""

    def __init__(
        self,
        root: Path | None,
        allowed: bool = True,
        max_steps: int = 0,
        remote: Remote | None = None,
        node: str = "node",
        floor: Policy | None = None,
    ) -> None:
        if isinstance(floor, KeepSteps) and not floor.steps:
            floor = None  # the option's default: nothing more
        self.path = None if root is None else root / FILE
        self.allowed = allowed
        self.max_steps = max_steps
        self.remote = remote
        self.node = node
        self.floor = floor
        """What the durable tier keeps of every job whatever its own policy (the
        operator's ``job_retention_floor``; None: nothing more)."""
        self._bucket: dict[str, str] = {}  # that record's text ("" none), once known
        self._dirty: set[str] = set()  # jobs whose bucket record may be behind
        self._warned: set[str] = set()
        self._looking: set[str] = set()  # jobs whose record is being read by look_up
        self._tasks: set[asyncio.Task[None]] = set()
        self._texts: dict[str, str] = {}
        self._policies: dict[str, Policy] = {}
        self._lock = threading.Lock()  # set() runs on a thread: one change and file at once
        self._load()

    @classmethod
    def of(cls, root: Path, limits: Limits, remote: Remote | None, node: str) -> JobRetention:
        """The jobs' policies under ``root``, within the operator's ``limits``."""
        return cls(
            root,
            limits.job_retention,
            limits.job_retention_max_steps,
            remote,
            node,
            limits.job_retention_floor,
        )

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            saved = json.loads(read_small(self.path))
            texts = {str(j): str(t) for j, t in dict(saved.get("jobs", {})).items()}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.error("%s is unreadable (%s): jobs keep the node's retention", self.path, exc)
            return
        for job, text in texts.items():
            try:
                self._put(job, text)
            except PolicyError as exc:  # written by an older daemon that knew more
                log.error("job %r's retention %r no longer parses (%s); ignored", job, text, exc)
        self._dirty.update(self._texts)  # the bucket's record may have missed a change

    def _put(self, job: str, text: str) -> Policy:
        policy = parse_policy(text)
        if self.max_steps > 0:
            policy = KeepAtMost(policy, self.max_steps)
        self._texts[job], self._policies[job] = text, policy
        return policy

    def set(self, job: str, text: str) -> Policy | None:
        """Make ``text`` job's retention ("" gives it the node's back); the policy in
        force (after the operator's limit), None for the node's. Raises InvalidArgument
        for a policy that does not parse, FailedPrecondition where the operator turned
        job policies off."""
        with self._lock:
            return self._set(job, text.strip())

    def _set(self, job: str, text: str) -> Policy | None:
        if not text:
            if self._texts.pop(job, None) is not None:
                self._policies.pop(job, None)
                self._save()
            return None
        if not self.allowed:
            raise FailedPrecondition(
                f"this daemon keeps its own retention for every job (job_retention = false): "
                f"job {job!r}'s policy {text!r} is not applied; ask the operator, or keep "
                "the framework's default"
            )
        if len(text) > MAX_TEXT:
            raise InvalidArgument(f"a retention policy is at most {MAX_TEXT} characters")
        if self._texts.get(job) == text:
            return self._policies[job]
        try:
            policy = self._put(job, text)
        except PolicyError as exc:
            raise InvalidArgument(f"job {job!r}'s retention: {exc}") from None
        self._save()
        log.info("job %r keeps its own retention: %s", job, policy.describe())
        return policy

    async def set_everywhere(self, job: str, text: str) -> Policy | None:
        """:meth:`set` (on a thread: it fsyncs), then this node's record of it in the
        bucket (only when it changed); a bucket that does not answer gets it at the
        evictor's next pass."""
        policy = await asyncio.to_thread(self.set, job, text)
        if self._texts.get(job, "") != self._bucket.get(job):  # None: never read or written
            self._dirty.add(job)
        await self.sync(job)
        return policy

    async def sync(self, job: str | None = None) -> None:
        """Write this node's bucket record of ``job``'s policy (None: of every job whose
        record may be behind: set or cleared here, or loaded at start-up)."""
        if self.remote is None:
            self._dirty.clear()
            return
        for name in [job] if job is not None else sorted(self._dirty):
            if name not in self._dirty:
                continue
            text = self._texts.get(name, "")
            key = retention_key(name, self.node)
            try:
                if text:
                    await self.remote.put_bytes(key, json.dumps({"policy": text}).encode())
                else:
                    await self.remote.delete([key])
            except Exception as exc:  # the evictor's next pass tries again
                log.warning("cannot record job %r's retention in the bucket: %s", name, exc)
                continue
            if self._texts.get(name, "") == text:  # not changed again meanwhile
                self._dirty.discard(name)
            self._bucket[name] = text

    def look_up(self, job: str) -> None:
        """Start reading ``job``'s record in the background (a job's first lease: the
        policy is then known before its step is pending, and the save never waits
        for the bucket)."""
        if self.known(job) or job in self._looking:
            return
        self._looking.add(job)
        task = asyncio.get_running_loop().create_task(self._look_up(job))
        self._tasks.add(task)  # held: the loop keeps only a weak reference
        task.add_done_callback(self._tasks.discard)

    async def _look_up(self, job: str) -> None:
        try:
            await self.settled(job)
        except Exception as exc:  # the evictor's pass asks again
            log.error("reading job %r's retention record failed: %s", job, exc)
        finally:
            self._looking.discard(job)

    async def settle_all(self, jobs: Iterable[str]) -> None:
        """Read the records of ``jobs`` side by side (start-up: the evictor's first pass
        then finds each job's policy known; each read waits at most READ_TIMEOUT)."""
        await asyncio.gather(*(self.settled(j) for j in jobs if not self.known(j)),
                             return_exceptions=True)  # fmt: skip

    def known(self, job: str) -> bool:
        """Whether ``job``'s policy is known here: no bucket, a policy set or loaded
        here, or this node's bucket record read (or found absent)."""
        return self.remote is None or job in self._texts or job in self._bucket

    async def settled(self, job: str) -> bool:
        """Whether ``job``'s policy is known (:meth:`known`), reading this node's bucket
        record once if need be (a replacement node's daemon, before any trainer of
        the job reconnects). False while the bucket does not answer: the job's bucket
        copies wait."""
        if self.known(job):
            return True
        assert self.remote is not None
        try:
            raw = await asyncio.wait_for(
                self.remote.get_bytes(retention_key(job, self.node)), READ_TIMEOUT
            )
        except (FileNotFoundError, NotFound):
            raw = b""
        except TimeoutError:  # a store that hangs: asked again at the next pass
            return False
        except Exception as exc:  # a transient error, or one an operator must fix
            if not self.remote.is_transient(exc) and job not in self._warned:
                self._warned.add(job)
                log.error(
                    "cannot read job %r's retention record in the bucket (%s): its bucket "
                    "copies are kept until it can be read",
                    job,
                    exc,
                )
            return False
        if self.known(job):  # a trainer set the job's policy meanwhile: it is newer
            return True
        try:
            text = str(json.loads(raw)["policy"]) if raw else ""
        except (ValueError, KeyError, TypeError) as exc:
            log.error("job %r's retention record is not usable (%s); node's kept", job, exc)
            text = ""
        self._bucket[job] = text  # known from here on, while the policy is applied
        if text:
            try:
                await asyncio.to_thread(self.set, job, text)
            except (InvalidArgument, FailedPrecondition) as exc:
                log.error("job %r's retention record is not usable (%s); node's kept", job, exc)
        return True

    def policy(self, job: str) -> Policy | None:
        """The job's own policy in force, None: the node's."""
        return self._policies.get(job) if self.allowed else None

    def tiers(self, job: str, local: Policy, remote: Policy | None) -> tuple[Policy, Policy | None]:
        """The (local, remote) policies the plan applies to ``job``'s live history.
        Until the job's policy is known (:meth:`known`), the bucket wants every step:
        no upload is passed over, and the evictor removes none of its bucket copies."""
        if not self.known(job):
            return local, KeepAll()
        own = self.policy(job)
        if own is None:
            return local, remote
        durable = KeepAny((own, KeepMilestones(), *([self.floor] if self.floor else [])))
        if remote is None:
            return durable, None
        return KeepBoth(local, durable), durable

    def abandoned(
        self, job: str, local: Policy, remote: Policy | None
    ) -> tuple[Policy, Policy | None]:
        """The policies for ``job``'s abandoned timelines (an older run under the same
        name): what the node's policies or the job's keep, never fewer than before."""
        live_local, live_remote = self.tiers(job, local, remote)
        if live_local is local and live_remote is remote:
            return local, remote
        keep_remote = None if remote is None else KeepAny((remote, live_remote or remote))
        return KeepAny((local, live_local)), keep_remote

    def _save(self) -> None:
        if self.path is None:
            return
        data = json.dumps({"jobs": self._texts}, indent=1, sort_keys=True).encode()
        replace_synced(self.path, data)


__all__ = ["FILE", "JobRetention", "KeepAtMost", "KeepBoth"]
