"""The state machine hypothesis drives: each rule is one operation on the real daemon
and the same operation on the model; after each, the daemon is let go quiet and
checked (checks.py). A failing sequence shrinks to a minimal one, printed as calls
of these rules (test_model_check.py replays such sequences as regression tests).

Step numbers stay small and start again at 0 for a new run, versions come from a
small range and most saves change only some arrays, so reused names, rollbacks,
replacements and incremental saves that reference older steps come up often.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ckptd.client import CheckpointNotFound, CkptdError, Client, Conflict, SaveFailed
from ckptd.client.handle import SaveHandle

from .checks import SLOW_QUIET_SECONDS, STATS, Checker, Violation, check, operation
from .model import Model, PinnedConflict, Saved
from .process_rules import ROOT_JOBS, ProcessRules
from .trees import FLAVORS, KEYS, Arrays, differences
from .world import Resources, Settings, World

JOBS = ROOT_JOBS
VERSIONS = st.integers(0, 5)
CHANGES = st.frozensets(st.sampled_from(KEYS), max_size=len(KEYS))
"""Which arrays a save changes; the others are frozen (an incremental save references
the older step that holds them). Empty: nothing changed."""
PIN_OR_UNPIN = [True, True, False]
MILESTONE = st.sampled_from([False, False, False, True])
"""A milestone now and then: the bucket keeps it whatever its policy."""
SETTINGS = st.builds(
    Settings,
    keep=st.integers(1, 3),
    local_keep=st.integers(1, 3),
    memory_steps=st.sampled_from([1, 0, 2]),
    pressure=st.booleans(),
    peer=st.booleans(),
)


@dataclass
class Trainer:
    """One run of a job: its client and arrays, and the step it saves next."""

    client: Client
    arrays: Arrays
    next_step: int = 0


class DaemonMachine(ProcessRules, RuleBasedStateMachine):
    """One node: a real daemon, its bucket, trainers of two jobs, and the model."""

    resources: Resources | None = None
    """Set by the test before hypothesis runs the machine (one SeaweedFS per run)."""

    def __init__(self) -> None:
        super().__init__()
        assert self.resources is not None, "set DaemonMachine.resources first"
        self.world: World | None = None
        self.model = Model(keep=1)
        self.checker: Checker | None = None
        self.trainers: dict[str, Trainer] = {}
        self.pending: list[tuple[Saved, SaveHandle]] = []
        self.user_versions: dict[int, tuple[int, ...]] = {}
        self.failed = False
        self.ops = 0
        """Operations run so far (the start one of them)."""
        self.trace: list[str] = []
        """Each operation run so far, with its arguments (a failure's report)."""
        STATS.sequences += 1

    # -- start ---------------------------------------------------------------------------
    @initialize(settings=SETTINGS)
    @operation
    def start(self, settings: Settings) -> None:
        """A fresh root and bucket prefix; the daemon configured by ``settings``."""
        assert self.resources is not None
        self.world = World(self.resources, settings)
        self.model = Model(keep=settings.keep)
        self.checker = Checker(self.world, self.model)
        self.world.start()

    @property
    def w(self) -> World:
        assert self.world is not None
        return self.world

    def trainer(self, job: str, flavor: str = "numpy", incremental: bool = True) -> Trainer:
        """The job's current run (a first one if none)."""
        if job not in self.trainers:
            arrays = Arrays(flavor, (0,) * len(KEYS))
            self.trainers[job] = Trainer(self.w.client(job, incremental), arrays)
        return self.trainers[job]

    def save(
        self,
        job: str,
        step: int,
        changes: frozenset[str],
        version: int,
        milestone: bool = False,
        wait: bool = True,
    ) -> Saved | None:
        """One save by the job's trainer, checked against what the model expects: the
        saved step, or a refusal when a pinned step holds the number."""
        t = self.trainer(job)
        versions = tuple(
            version if k in changes else v for k, v in zip(KEYS, t.arrays.versions, strict=True)
        )
        t.arrays.set(versions)
        try:
            expect: Saved | None = self.model.prepare(
                job, step, versions, t.arrays.flavor, milestone
            )
        except PinnedConflict:
            expect = None
        try:
            handle = t.client.save(
                step, t.arrays.tree(), metadata={"sid": expect.sid if expect else 0},
                milestone=milestone,
            )  # fmt: skip
            if expect is None:  # jax arrays go on a client thread: the answer comes later
                handle.wait("local", timeout=120)
        except Conflict as exc:
            check(expect is None, f"save of {job}/{step} refused: {exc}")
            t.next_step = step + 1
            return None
        check(expect is not None, f"{job}/{step} replaced a pinned step: the save went through")
        assert expect is not None
        self.model.commit(expect)
        t.next_step = step + 1
        if wait:
            self.settle_save(expect, handle)
        else:
            self.pending.append((expect, handle))
        return expect

    def settle_save(self, s: Saved, handle: SaveHandle, superseded_ok: bool = False) -> None:
        """An acknowledged save reaches LOCAL (no fault here may fail it), or, with
        ``superseded_ok`` (a newer save of its job was acknowledged right after it), ends
        SUPERSEDED: then the model forgets it."""
        try:
            handle.wait("local", timeout=120)
        except SaveFailed as exc:
            if superseded_ok and exc.code == "SUPERSEDED":
                STATS.operations["a burst's older save superseded"] += 1
                if self.model.job(s.job).held.get(s.step) is s:
                    self.model.forget(s.job, s.step)
                return
            raise Violation(f"acknowledged save {s.label()} failed: {exc}") from exc

    # -- operations ----------------------------------------------------------------------
    @rule(
        job=st.sampled_from(JOBS),
        changes=CHANGES,
        version=VERSIONS,
        milestone=MILESTONE,
        count=st.integers(1, 3),
    )
    @operation
    def save_next(
        self, job: str, changes: frozenset[str], version: int, milestone: bool, count: int
    ) -> None:
        """The job's trainer saves its next ``count`` steps back to back, waiting for none
        (the same arrays change in each, to the same version: the first save changes
        them, the others not). The newest reaches LOCAL; an older one may instead end
        SUPERSEDED, when the newer one's bytes were in before its write began
        (docs/guarantees.md): it is gone, as if never saved."""
        burst: list[tuple[Saved, SaveHandle]] = []
        for _ in range(count):
            step = self.trainer(job).next_step
            if self.save(job, step, changes, version, milestone, wait=False) is not None:
                burst.append(self.pending.pop())
        for i, (s, handle) in enumerate(burst):
            self.settle_save(s, handle, superseded_ok=i < len(burst) - 1 and not s.milestone)

    @rule(
        job=st.sampled_from(JOBS),
        flavor=st.sampled_from(FLAVORS),
        incremental=st.sampled_from([True, True, False]),
        version=VERSIONS,
    )
    @operation
    def new_run(self, job: str, flavor: str, incremental: bool, version: int) -> None:
        """A new run under the job's name: a new client saves step 0 again, whatever
        steps an older run left."""
        old = self.trainers.pop(job, None)
        if old is not None:
            old.client.close()
        t = self.trainer(job, flavor, incremental)
        t.arrays.set((version,) * len(KEYS))
        self.save(job, 0, frozenset(), version)

    @rule(job=st.sampled_from(JOBS), pick=st.integers(0, 3), changes=CHANGES, version=VERSIONS)
    @operation
    def rollback(self, job: str, pick: int, changes: frozenset[str], version: int) -> None:
        """Restore an older live step the rules keep, and save on from it (nothing
        without such a step)."""
        targets = self.rollback_targets(job)
        if not targets:
            return
        target = targets[-1 - pick % len(targets)]
        t = self.trainer(job)
        try:
            tree, meta = t.client.restore(step=target.step)
        except CkptdError as exc:
            self.refused_in_outage(f"restore of {target.label()}", exc)
            return
        check(meta.get("sid") == target.sid, f"restore of {target.label()} gave {meta}")
        wrong = differences(tree, target.versions)
        check(not wrong, f"restore of {target.label()}: {'; '.join(wrong)}")
        del tree
        t.arrays.set(target.versions)
        self.save(job, target.step + 1, changes, version)

    def refused_in_outage(self, what: str, exc: CkptdError) -> None:
        """A restore may be refused while the bucket is away (the step may be only
        there), with an error that says so; never otherwise."""
        check(not self.w.bucket_up, f"{what} failed: {exc}")
        check("internal error" not in str(exc), f"{what} during a bucket outage: {exc}")

    def rollback_targets(self, job: str) -> list[Saved]:
        """Live steps below the newest that the rules keep (present for sure)."""
        kept = self.model.must_keep(job)
        return [s for s in self.model.live(job)[:-1] if s.step in kept]

    @rule(job=st.sampled_from(JOBS))
    @operation
    def resume(self, job: str) -> None:
        """The trainer restarts: a new client restores the newest step and goes on."""
        top = self.model.top(job)
        old = self.trainers.pop(job, None)
        if old is not None:
            old.client.close()
        t = self.trainer(job, old.arrays.flavor if old else "numpy")
        if top is None:
            return
        try:
            tree, meta = t.client.restore()
        except CkptdError as exc:
            self.refused_in_outage(f"restore() of {top.label()}", exc)
            return
        check(meta.get("sid") == top.sid, f"restore() should give {top.label()}, gave {meta}")
        check(not differences(tree, top.versions), f"restore() of {top.label()} differs")
        del tree
        t.arrays.set(top.versions)
        t.next_step = top.step + 1

    @rule(job=st.sampled_from(JOBS), pick=st.integers(0, 7), on=st.sampled_from(PIN_OR_UNPIN))
    @operation
    def pin(self, job: str, pick: int, on: bool) -> None:
        """Pin (or unpin) one of the steps the node may hold."""
        held = sorted(self.model.job(job).held.values(), key=lambda s: s.step)
        if not held:
            return
        s = held[pick % len(held)]
        try:
            self.trainer(job).client.pin(s.step, on)
        except CheckpointNotFound as exc:
            check(s.expendable, f"pin({on}) of {s.label()}, which the rules keep: {exc}")
            self.model.forget(job, s.step)
            return
        except CkptdError as exc:
            # The bucket records pins too: during an outage a pin may be refused, with
            # a clear error, and nothing changes.
            check(not self.w.bucket_up, f"pin({on}) of {s.label()} failed: {exc}")
            check(
                "internal error" not in str(exc),
                f"pin({on}) of {s.label()} during a bucket outage: {exc}",
            )
            return
        self.model.pin(job, s.step, on)

    @rule(
        how=st.sampled_from(["kill", "stop", "wipe"]),
        in_flight=st.booleans(),
        job=st.sampled_from(JOBS),
    )
    @operation
    def restart_daemon(self, how: str, in_flight: bool, job: str) -> None:
        """SIGKILL (``kill``) or stop the daemon and start it again on the same root, or
        lose the node (``wipe``: its disk and memory; what the bucket holds complete
        comes back, and the newest replica the peer holds of each job unless the bucket
        holds a newer step). With ``in_flight``, right after a save it acknowledged but
        has not written yet (``wipe``: the drain is let finish first, so the model knows
        what the bucket holds)."""
        if in_flight and how != "wipe":
            self.save(job, self.trainer(job).next_step, frozenset(KEYS[:1]), 4, wait=False)
        survivors: set[tuple[str, int]] = set()
        if how == "wipe":
            if self.w.bucket_up:
                self.w.quiesce()
            for name in self.model.jobs:
                rows = self.w.listing(name).items()
                survivors |= {(name, step) for step, row in rows if "REMOTE" in row.tiers}
        replicas: dict[str, tuple[int, int, Any]] = {}

        def down() -> None:  # what the peer holds, read while no daemon can change it
            peer = self.w.node.peer
            if how != "wipe" or peer is None or not peer.running():
                return
            for name in self.model.jobs:
                held = self.w.node.replicas(name)
                if held:
                    n = max(held, key=lambda n: (held[n][0], n))
                    replicas[name] = (n, held[n][0], held[n][1].get("sid"))

        self.w.restart(how, down)
        if how == "wipe":
            back = []
            for name, (step, timeline, sid) in replicas.items():
                # The new daemon takes the job's newest replica back, unless the bucket
                # holds a newer step (docs/operating/peer-tier.md).
                held = self.model.job(name).held
                bucket = [held[n] for j, n in survivors if j == name and n in held]
                taken = all((b.timeline, b.step) < (timeline, step) for b in bucket)
                if taken and sid in self.model.archive:
                    back.append(self.model.archive[sid])
            self.model.node_lost(survivors)
            for s in back:
                self.model.commit(s)

    @rule(up=st.booleans())
    @operation
    def bucket(self, up: bool) -> None:
        """A bucket outage begins (or ends)."""
        self.w.set_bucket(up)

    @rule(up=st.booleans())
    @operation
    def peer(self, up: bool) -> None:
        """The peer node is lost (SIGKILL, its disk kept) or comes back (nothing without
        a peer)."""
        self.w.set_peer(up)

    @rule()
    @operation
    def verify_all(self) -> None:
        """Every copy of every listed step, read back from each tier that claims it (a
        bucket outage ends first: the bucket's copies are read too)."""
        if not self.w.bucket_up:
            self.w.set_bucket(True)
        self.quiet()
        assert self.checker is not None
        self.checker.full()

    # -- after every operation ---------------------------------------------------------------
    def quiet(self) -> None:
        """Every acknowledged save LOCAL, the drain idle (bucket up), the model settled."""
        pending, self.pending = self.pending, []
        for s, handle in pending:
            self.settle_save(s, handle)
        began = time.monotonic()
        self.w.quiesce()
        waited = time.monotonic() - began
        STATS.slowest_quiet = max(STATS.slowest_quiet, waited)
        if waited > SLOW_QUIET_SECONDS and len(STATS.slow_quiets) < 5:
            STATS.slow_quiets.append(
                f"{waited:.0f} s after operation {self.ops} ({self.w.settings}):\n"
                + self.w.daemon.log_tail(15)
            )
        self.model.settle()

    @invariant()
    def agrees(self) -> None:
        """The quick checks, once the daemon is quiet."""
        if self.world is None or self.failed:
            return
        began = time.monotonic()
        try:
            self.quiet()
            assert self.checker is not None
            self.checker.quick()
        except BaseException:
            self.failing()
            raise
        finally:
            STATS.seconds["check"] += time.monotonic() - began

    def failing(self) -> None:
        """This sequence failed (counted once, by what raised)."""
        if not self.failed:
            exc = sys.exc_info()[1]
            if exc is not None:
                STATS.failed(exc, list(self.trace))
        self.failed = True

    def teardown(self) -> None:
        """The full check at the end of a sequence that has not failed, bucket up."""
        if self.world is None:
            return
        began = time.monotonic()
        try:
            if not self.failed:
                if not self.w.bucket_up:
                    self.w.set_bucket(True)
                self.quiet()
                assert self.checker is not None
                self.checker.full()
                if self.ops > STATS.steps:
                    STATS.full_length += 1
        except BaseException:
            self.failing()
            raise
        finally:
            STATS.seconds["final check"] += time.monotonic() - began
            self.w.close()
