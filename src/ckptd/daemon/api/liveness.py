"""Which jobs a live process is saving: the sessions that saved or adopted each job.

A job counts as running while a process that saved it (leases, commits, pins,
adoptions, watches) still holds its session: the session socket closes when the
process exits (sessions.py), so a finished or crashed trainer's jobs stop counting
at once, without a timer. Metrics report a job's exposure only while it runs: the
newest checkpoint of a job that ended ages forever, and alerting on it is noise.
"""

from __future__ import annotations


class LiveJobs:
    """Jobs with at least one session that saved them; methods run on the event loop."""

    def __init__(self) -> None:
        self._sessions: dict[str, set[str]] = {}
        """Job -> tokens of the live sessions that saved it."""
        self._jobs: dict[str, set[str]] = {}
        """Token -> jobs it saved (what to drop when the session ends)."""
        self._uids: dict[str, int] = {}
        """Token -> the uid of its process."""

    def saving(self, token: str, job: str, uid: int) -> None:
        """The session ``token`` of a process of ``uid`` saved ``job`` (called on every
        save call: dictionary and set lookups only)."""
        jobs = self._jobs.setdefault(token, set())
        if job not in jobs:
            jobs.add(job)
            self._sessions.setdefault(job, set()).add(token)
            self._uids[token] = uid

    def ended(self, token: str) -> None:
        """The session ``token`` closed (its process exited or closed its client)."""
        self._uids.pop(token, None)
        for job in self._jobs.pop(token, ()):
            tokens = self._sessions.get(job)
            if tokens is not None:
                tokens.discard(token)
                if not tokens:
                    del self._sessions[job]

    def jobs(self) -> frozenset[str]:
        """The jobs some live process is saving."""
        return frozenset(self._sessions)

    def uids(self) -> frozenset[int]:
        """The uids of the processes saving now (operators, who own no job, included)."""
        return frozenset(self._uids.values())
