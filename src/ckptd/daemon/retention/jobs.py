"""Retention set by a job's trainer: the framework's own knobs (Orbax ``max_to_keep``,
``best_fn`` and ``keep_period``; torchtitan ``keep_latest_k``; the HF Trainer's
``save_total_limit`` and best checkpoint; Lightning's top-k) become the job's
retention, so what the framework lists is what exists.

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

The safety rules of plan.py hold as for the node's policies (the newest step, pins,
copies still being read, copies the bucket still needs). The policies are kept in
``<root>/job-retention.json`` (replaced whole, fsynced), so a daemon restarted under
a running trainer goes on with them, and in the bucket (``<job>/_retention.json``),
so a replacement node's daemon, which finds the job's steps there, applies the
job's policy to them, not its own, before any trainer connects: the evictor learns
a job's policy from the bucket before it removes any of the job's bucket copies
(:meth:`JobRetention.settled`), and writes the ones the bucket missed (a transient
error at ``SetRetention``) at each pass. A trainer sends its own again at start-up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd.core.errors import FailedPrecondition, InvalidArgument, NotFound

from ..files import read_small, replace_synced
from ..remote.layout import retention_key
from .policies import Checkpoint, KeepAny, KeepMilestones, Kept, Policy, PolicyError, parse_policy

if TYPE_CHECKING:
    from ..lifecycle.options import LifecycleOptions
    from ..remote.base import Remote

log = logging.getLogger("ckptd.retention")

FILE = "job-retention.json"
MAX_TEXT = 4096
"""Longest policy text a trainer may send (a few dozen policies)."""


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
    ) -> None:
        self.path = None if root is None else root / FILE
        self.allowed = allowed
        self.max_steps = max_steps
        self.remote = remote
        self._looked: set[str] = set()  # jobs whose bucket record was read (or written)
        self._unsynced: set[str] = set()  # jobs whose bucket record is behind
        self._texts: dict[str, str] = {}
        self._policies: dict[str, Policy] = {}
        self._lock = threading.Lock()  # set() runs on a thread: one change and file at once
        self._load()

    @classmethod
    def of(cls, root: Path, options: LifecycleOptions, remote: Remote | None) -> JobRetention:
        """The jobs' policies under ``root``, within ``options``' limits."""
        return cls(root, options.job_retention, options.job_retention_max_steps, remote)

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
        """:meth:`set` (on a thread: it fsyncs), then the bucket's record of it; a
        bucket that does not answer gets it at the evictor's next pass."""
        policy = await asyncio.to_thread(self.set, job, text)
        self._unsynced.add(job)
        await self.sync(job)
        return policy

    async def sync(self, job: str | None = None) -> None:
        """Write the bucket's record of ``job``'s policy (None: of every job behind)."""
        if self.remote is None:
            self._unsynced.clear()
            return
        for name in [job] if job is not None else sorted(self._unsynced):
            if name not in self._unsynced:
                continue
            text = self._texts.get(name, "")
            key = retention_key(name)
            try:
                if text:
                    await self.remote.put_bytes(key, json.dumps({"policy": text}).encode())
                else:
                    await self.remote.delete([key])
            except Exception as exc:  # the evictor's next pass tries again
                log.warning("cannot record job %r's retention in the bucket: %s", name, exc)
                continue
            self._unsynced.discard(name)
            self._looked.add(name)

    async def settled(self, job: str) -> bool:
        """Whether ``job``'s policy is known: its own (set here, or read from the
        bucket, once), or the node's because the bucket holds none. False while the
        bucket does not answer: the job's bucket copies wait."""
        if self.remote is None or job in self._looked or job in self._texts:
            return True
        try:
            raw = await self.remote.get_bytes(retention_key(job))
        except (FileNotFoundError, NotFound):
            self._looked.add(job)
            return True
        except Exception as exc:
            if not self.remote.is_transient(exc):
                raise
            return False
        self._looked.add(job)
        try:
            text = str(json.loads(raw)["policy"])
            await asyncio.to_thread(self.set, job, text)
        except (ValueError, KeyError, TypeError, InvalidArgument, FailedPrecondition) as exc:
            log.error("job %r's retention in the bucket is not usable (%s); node's kept", job, exc)
        return True

    def policy(self, job: str) -> Policy | None:
        """The job's own policy in force, None: the node's."""
        return self._policies.get(job) if self.allowed else None

    def tiers(self, job: str, local: Policy, remote: Policy | None) -> tuple[Policy, Policy | None]:
        """The (local, remote) policies the plan applies to ``job``."""
        own = self.policy(job)
        if own is None:
            return local, remote
        durable = KeepAny((own, KeepMilestones()))
        if remote is None:
            return durable, None
        return KeepBoth(local, durable), durable

    def _save(self) -> None:
        if self.path is None:
            return
        data = json.dumps({"jobs": self._texts}, indent=1, sort_keys=True).encode()
        replace_synced(self.path, data)


__all__ = ["FILE", "JobRetention", "KeepAtMost", "KeepBoth"]
