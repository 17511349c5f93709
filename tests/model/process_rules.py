"""The machine's operations that need processes of their own: a trainer SIGKILLed in
the middle of a save, and trainers running as two other users (each saving its own
job, and trying to see the other's: listings, restores, error messages and ``ckptd
ls`` hints must not show it).

A mixin of :class:`machine.DaemonMachine` (it supplies ``w``, ``model``, ``checker``
and ``trainer``)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import rule

from .checks import check, operation
from .processes import KILL_POINTS, kill_mid_save
from .trees import KEYS

USER_JOBS = ("ta-run", "tb-run")
"""Each test user's job (USERS order)."""
ROOT_JOBS = ("alpha", "beta")
"""The jobs root's trainers save (machine.JOBS)."""


def near_miss(job: str) -> str:
    """A name one letter short of ``job``: close enough for a "did you mean" hint."""
    return job[:-1]


class ProcessRules:
    """Operations on trainer processes (mixed into the state machine)."""

    w: Any
    model: Any
    checker: Any
    trainer: Any
    user_versions: dict[int, tuple[int, ...]]

    @rule(
        job=st.sampled_from(ROOT_JOBS),
        point=st.sampled_from(KILL_POINTS),
        flavor=st.sampled_from(["numpy", "torch"]),
        version=st.integers(0, 5),
    )
    @operation
    def kill_trainer(self, job: str, point: str, flavor: str, version: int) -> None:
        """A trainer process saving a new step of ``job`` is SIGKILLed at ``point``: once
        ``save()`` returned the step must commit; before its commit was sent it must never
        show; in between either, but whatever shows restores bit-exact."""
        t = self.trainer(job)
        # Above every held number: no new timeline, nothing replaced, whatever happens.
        step = max([t.next_step, *(n + 1 for n in self.model.job(job).held)])
        versions = (version, *t.arrays.versions[1:])
        s = self.model.prepare(job, step, versions, flavor, False)
        said = kill_mid_save(self.w.daemon.socket, job, step, s.sid, flavor, versions, point)
        t.next_step = step + 1
        self.w.quiesce()
        row = self.w.listing(job).get(step)
        if point == "acked" or f"ACK {step}" in said:
            check(row is not None, f"{s.label()}: save() returned, its trainer died, it is gone")
        elif point in ("mid-copy", "before:CommitShards"):
            check(row is None, f"{s.label()}: never whole, its trainer died, yet it is listed")
        if row is not None:
            tree, meta, served = self.checker.read(job, step, memory=False)
            self.checker.same(s, tree, meta, f"a killed trainer's save, served by {served}")
            self.model.commit(s)

    @rule(user=st.sampled_from([0, 1]), changes=st.frozensets(st.sampled_from(KEYS)))
    @operation
    def user_save(self, user: int, changes: frozenset[str]) -> None:
        """Test user ``user`` saves the next step of its own job."""
        if self.w.resources.users_missing:
            return
        job = USER_JOBS[user]
        top = self.model.top(job)
        old = self.user_versions.get(user, (0,) * len(KEYS))
        bump = (max(old) + 1) % 6
        versions = tuple(bump if k in changes else v for k, v in zip(KEYS, old, strict=True))
        step = 0 if top is None else max(self.model.job(job).held) + 1
        s = self.model.prepare(job, step, versions, "numpy", False)
        answer = self.w.user(user).ask(
            op="save", job=job, step=step, sid=s.sid, versions=list(versions)
        )
        check(answer.get("ok") is True, f"user {user}'s save of {s.label()}: {answer}")
        self.model.commit(s)
        self.user_versions[user] = versions

    @rule(user=st.sampled_from([0, 1]), probe=st.sampled_from(["list", "restore", "hint"]))
    @operation
    def user_probe(self, user: int, probe: str) -> None:
        """Test user ``user`` looks for the other user's job: it lists only its own (and
        root's: an operator's jobs have no owner, docs/security.md), restores its own
        (the newest live step, bit-exact) but not the other's, and no answer or hint
        names the other's job."""
        if self.w.resources.users_missing:
            return
        me = USER_JOBS[user]
        foreign = [USER_JOBS[1 - user]]
        u = self.w.user(user)
        if probe == "list":
            answer = u.ask(op="list", job="")
            seen = {job for job, _ in answer.get("steps", [])}
            other = sorted(seen - {me, *ROOT_JOBS})
            check(not other, f"user {user} lists another user's jobs: {other}")
            top = self.model.top(me)
            if top is not None:
                mine = u.ask(op="restore", job=me)
                check(
                    mine.get("sid") == top.sid and mine.get("versions") == list(top.versions),
                    f"user {user}'s restore() of its own job should give {top.label()}: {mine}",
                )
            return
        for job in foreign:
            if probe == "restore":
                answer = u.ask(op="restore", job=job)
                check("error" in answer, f"user {user} restored {job}, not its job: {answer}")
                continue
            asked = near_miss(job)  # a typo of it: no hint may name it
            for op in ("restore", "ls"):
                answer = u.ask(op=op, job=asked)
                text = str(answer.get("message", "")) + str(answer.get("text", ""))
                check(job not in text, f"user {user}'s {op} of {asked!r} names {job!r}: {text!r}")
