"""The checks after every operation (quick: listings only) and at the end of a
sequence or when the machine asks (full: every copy of every listed step read back
from every tier that claims it). Each failed check raises :class:`Violation` from
its own line, so hypothesis tells different failures apart and shrinks each.

Quick checks never restore: a restore keeps the step from eviction for two minutes
(docs/operating/retention.md, ``in-use``), which would hide the evictor's mistakes.
"""

from __future__ import annotations

import functools
import gc
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ckptd.client import CheckpointInfo, CkptdError, Client, mapped_views

from . import tiers
from .model import Model, Saved
from .trees import differences
from .world import World

SLOW_QUIET_SECONDS = 10.0
CLAIM_SETTLE_SECONDS = 10.0
"""How long a listing may go on claiming a copy that was just removed."""


class Violation(AssertionError):
    """The daemon broke a rule the model states."""


@dataclass
class Stats:
    """What a run did, for its report (bench/results/model-check.json)."""

    sequences: int = 0
    operations: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Time spent in each kind of operation (and in the checks: "check")."""
    checks: int = 0
    """Individual invariants checked (one step present, one copy bit-exact, ...)."""
    copies_read: Counter[str] = field(default_factory=Counter)
    """Copies read back and compared, by the tier that served them."""
    failures: int = 0
    slowest_quiet: float = 0.0
    """The longest wait for the daemon to go quiet, in seconds."""
    slow_quiets: list[str] = field(default_factory=list)
    """Waits over SLOW_QUIET_SECONDS: after which operation, and what the daemon logged."""
    began: float = field(default_factory=time.monotonic)
    first_seen: dict[str, tuple[float, int, str]] = field(default_factory=dict)
    traces: list[dict[str, Any]] = field(default_factory=list)
    """The first failing sequences of each kind as they ran (settings, then each
    operation and its arguments): a failure hypothesis cannot replay (it depends on
    timing) is still there to read and to replay (run.py, ``replay``)."""
    """Each failure (by the line that raised it): when it first failed a sequence
    (seconds into the run, sequences run by then) and its message."""
    steps: int = 0
    """Operations asked for per sequence (hypothesis's ``stateful_step_count``)."""
    full_length: int = 0
    """Sequences that ran ``steps`` operations or more and passed every check."""

    def failed(self, exc: BaseException, trace: list[str] | None = None) -> None:
        """Count a failing sequence; remember when each kind of failure first showed."""
        self.failures += 1
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        site = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb else type(exc).__name__
        if site not in self.first_seen:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.first_seen[site] = (time.monotonic() - self.began, self.sequences, first)
        if trace is not None and len(self.traces) < 10:
            self.traces.append({"failure": str(exc).splitlines()[0][:500], "ran": trace})


STATS = Stats()


F = TypeVar("F", bound=Callable[..., Any])


def operation(fn: F) -> F:
    """Count the operation, and remember a failure so teardown skips the full check
    (an error raised there would hide the one that failed the sequence)."""

    @functools.wraps(fn)
    def run(self: Any, *args: Any, **kw: Any) -> Any:
        self.trace.append(f"{fn.__name__}({', '.join(f'{k}={v!r}' for k, v in kw.items())})")
        STATS.operations[fn.__name__] += 1
        self.ops += 1
        began = time.monotonic()
        try:
            return fn(self, *args, **kw)
        except BaseException:
            self.failing()
            raise
        finally:
            STATS.seconds[fn.__name__] += time.monotonic() - began

    return run  # type: ignore[return-value]


def check(ok: bool, message: str) -> None:
    """Count one invariant; raise :class:`Violation` with ``message`` if it fails."""
    STATS.checks += 1
    if not ok:
        raise Violation(message)


class Checker:
    """Compares one world's daemon with its model."""

    def __init__(self, world: World, model: Model) -> None:
        self.world = world
        self.model = model
        self._clients: dict[str, Client] = {}

    def client(self, job: str) -> Client:
        """The checker's own client of ``job`` (an operator restoring, not a trainer)."""
        if job not in self._clients:
            self._clients[job] = self.world.client(job)
        return self._clients[job]

    # -- quick: after every operation --------------------------------------------------
    def quick(self) -> None:
        """Every step the rules keep is listed, with the right pin and timeline; nothing
        is listed that no save made; the newest live step is the model's."""
        for job in sorted(self.model.jobs):
            rows = self.world.listing(job)
            held = self.model.job(job).held
            for step, why in sorted(self.model.must_keep(job).items()):
                s = held[step]
                if s.pinned:
                    check(step in rows, f"pinned step {s.label()} is gone: {_seen(rows)}")
                check(step in rows, f"{s.label()}, kept as {why}, is gone: {_seen(rows)}")
                check(rows[step].pinned == s.pinned, f"{s.label()}: pinned={rows[step].pinned}")
                gone = self.model.abandoned(s)
                check(
                    rows[step].abandoned == gone,
                    f"{s.label()} is listed {'abandoned' if rows[step].abandoned else 'live'},"
                    f" the timelines say {'abandoned' if gone else 'live'}",
                )
            for step, s in list(held.items()):
                if step not in rows and s.expendable:
                    self.model.forget(job, step)
            for step in sorted(set(rows) - set(held)):
                self.phantom(job, rows[step])
            top = self.model.top(job)
            live = [n for n, c in rows.items() if not c.abandoned]
            check(
                max(live, default=None) == (top.step if top else None),
                f"job {job}: the newest live step listed is {max(live, default=None)}, "
                f"the model's is {top.label() if top else None}: {_seen(rows)}",
            )

    def phantom(self, job: str, row: CheckpointInfo) -> None:
        """A listed step the model does not hold: a save it forgot (expendable, listed
        again after a restart) or a killed trainer's that committed; anything else was
        never acknowledged."""
        tree, meta, _ = self.read(job, row.step, memory=False)
        sid = meta.get("sid") if isinstance(meta, dict) else None
        s = self.model.archive.get(sid) if isinstance(sid, int) else None
        check(
            s is not None and (s.job, s.step) == (job, row.step),
            f"{job}/{row.step} is listed but no save made it: it holds save {sid}",
        )
        assert s is not None
        check(not differences(tree, s.versions), f"{s.label()}: {differences(tree, s.versions)}")
        s.expendable = s.expendable or s.step not in self.model.rule(job)
        self.model.commit(s)

    # -- full: every copy ----------------------------------------------------------------
    def full(self) -> None:
        """Every listed step restores bit-exact from every tier that claims it, and
        ``restore()`` gives the newest live step."""
        self.quick()
        in_bucket: list[tuple[Saved, CheckpointInfo]] = []
        for job in sorted(self.model.jobs):
            top = self.model.top(job)
            if top is not None:
                tree, meta, tier = self.read(job, None, memory=True)
                self.same(top, tree, meta, f"restore() from {tier}")
            held = self.model.job(job).held
            for step, row in sorted(self.world.listing(job).items()):
                s = held.get(step)
                if s is None:
                    continue  # listed since the quick check: checked next time
                self.copies(s, row)
                if "REMOTE" in row.tiers:
                    in_bucket.append((s, row))
        env = self.world.resources.reader_env()
        found = tiers.read_bucket(self.world.url, env, [(s.job, s.step) for s, _ in in_bucket])
        for s, row in in_bucket:
            got = found[s.job, s.step]
            if isinstance(got, CkptdError):
                self.lost(s, row, "REMOTE", got)
                continue
            STATS.copies_read["REMOTE (bucket)"] += 1
            self.same(s, *got, "the bucket's copy")
        gc.collect()  # restored views unmapped: their segments go back to the daemon

    def copies(self, s: Saved, row: CheckpointInfo) -> None:
        """Each copy of ``s`` on this node (memory, disk) that the listing claims."""
        reads: list[tuple[str, dict[str, Any]]] = []
        if "MEMORY" in row.tiers:
            reads.append(("MEMORY", {"memory": True}))
        if "LOCAL" in row.tiers:
            reads.append(("LOCAL", {"memory": False}))
            reads.append(("LOCAL", {"memory": False, "shared_memory": False}))
        for claimed, how in reads:
            try:
                tree, meta, served = self.read(s.job, s.step, **how)
            except CkptdError as exc:
                self.lost(s, row, claimed, exc)
                continue
            self.same(s, tree, meta, f"the copy {claimed} claims, served by {served}")
        replica = self.world.node.replica(s.job, s.step)
        if "PEER" in row.tiers and replica is not None:
            try:
                tree, meta = tiers.read_files(replica)
            except (OSError, ValueError, mapped_views.Corrupt) as exc:
                self.lost(s, row, "PEER", exc)
                return
            STATS.copies_read["PEER (replica)"] += 1
            self.same(s, tree, meta, "the peer's replica")

    def lost(self, s: Saved, row: CheckpointInfo, claimed: str, exc: Exception) -> None:
        """A copy a tier claimed did not restore: a failure unless the tier may drop it
        (an expendable step; the peer's replica of a step no longer the newest) and the
        listing stops claiming it soon (the daemon learns of a removal a moment after
        it happened)."""
        if claimed != "PEER" and s.step in self.model.must_keep(s.job):
            still = True
        else:
            deadline = time.monotonic() + CLAIM_SETTLE_SECONDS
            while (still := self.claims(s, claimed)) and time.monotonic() < deadline:
                time.sleep(0.05)
        if still:
            raise Violation(
                f"{s.label()}: listed in {claimed} ({', '.join(row.tiers)}) but "
                f"the copy there does not restore: {exc}"
            ) from exc

    def claims(self, s: Saved, tier: str) -> bool:
        """Whether the listing says ``tier`` holds ``s``."""
        row = self.world.listing(s.job).get(s.step)
        return row is not None and tier in row.tiers

    def read(
        self, job: str, step: int | None, *, memory: bool, shared_memory: bool = True
    ) -> tuple[Any, dict[str, Any], str]:
        """A restore through the daemon: ``(tree, metadata, serving tier)``."""
        tree, meta, tier = tiers.restore(
            self.client(job), step, memory=memory, shared_memory=shared_memory
        )
        STATS.copies_read[tier] += 1
        return tree, meta, tier

    def same(self, s: Saved, tree: Any, meta: dict[str, Any], how: str) -> None:
        """``tree`` and ``meta`` are exactly what save ``s`` held."""
        got = meta.get("sid") if isinstance(meta, dict) else None
        if got != s.sid:
            other = self.model.archive.get(got) if isinstance(got, int) else None
            check(
                False,
                f"{s.label()}: {how} holds "
                + (other.label() if other else f"metadata {meta!r}")
                + " instead",
            )
        wrong = differences(tree, s.versions)
        check(not wrong, f"{s.label()}: {how} differs from what was saved: {'; '.join(wrong)}")

    def close(self) -> None:
        """Nothing to close: the world closes the clients."""
        self._clients.clear()


def _seen(rows: dict[int, CheckpointInfo]) -> str:
    """The listing in one line, for failure messages."""
    parts = [
        f"{n}{'*' if c.abandoned else ''}{'(pinned)' if c.pinned else ''}:{'+'.join(c.tiers)}"
        for n, c in sorted(rows.items())
    ]
    return "listed " + (", ".join(parts) or "nothing") + " (* abandoned)"
