"""Save handles and the checkpoint listing type (the connection itself is
:class:`ckptd.core.wire.Connection`)."""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Protocol

from ckptd.core import health
from ckptd.core.errors import CkptdError, CkptdUnavailable, SaveFailed
from ckptd.core.wire import Connection
from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import state_name

STAGES = {"local": pb.SAVE_STATE_LOCAL, "durable": pb.SAVE_STATE_DURABLE}


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
    or holds ("newest", "pinned", "last-known-good", "awaiting-upload", "in-use")."""
    remote_reasons: tuple[str, ...] = ()
    pinned: bool = False
    metrics: dict[str, float] | None = None
    adopted: bool = False
    """A directory tree adopted from another framework (an Orbax step, ``adopt``)."""
    source: str = ""
    timeline: int = 0
    """The job's timeline this step was saved on: a save at or below the job's newest
    step (a rollback, a rerun under a reused job name) begins a new one."""
    abandoned: bool = False
    """A later timeline began at or below this step: ``restore()`` without a step,
    ``latest_step`` and ``all_steps`` skip it (``restore(step=N)`` still reads it)."""

    @property
    def healthy(self) -> bool | None:
        """No NaN/Inf in this node's copy (True), some (False; ``metrics["ckptd.nonfinite"]``
        says how many), or not counted (None: saved by an older ckptd, or adopted)."""
        return health.healthy(self.metrics)

    @classmethod
    def of(cls, c: pb.CheckpointInfo) -> CheckpointInfo:
        """From the daemon's ``ListCheckpoints`` row."""
        return cls(
            c.job,
            c.step,
            state_name(c.state),
            tuple(pb.Tier.Name(t).removeprefix("TIER_") for t in c.tiers),
            c.created_unix,
            c.size_bytes,
            c.num_shards,
            c.milestone,
            c.error,
            tuple(c.local_reasons),
            tuple(c.remote_reasons),
            c.pinned,
            dict(c.metrics),
            c.adopted,
            c.source,
            c.timeline,
            c.abandoned,
        )


class Owner(Protocol):
    """What a handle needs of its client: the job and the connection to the daemon."""

    @property
    def job(self) -> str:
        """The job saved."""

    @property
    def connection(self) -> Connection:
        """The connection to the daemon."""


class SaveHandle:
    """Returned by :meth:`Client.save`: the bytes are the daemon's; wait for a stage.

    ``SaveHandle(client, step)`` also makes a handle for a step saved earlier (by
    another process, or before a restart), to wait for it.
    """

    def __init__(self, client: Owner, step: int, copy: Future[None] | None = None) -> None:
        self.connection = client.connection
        self.job = client.job
        self.step = step
        self._copy = copy
        self.reused_bytes = 0
        """Bytes of shards not copied into shared memory: the segment the daemon
        granted held them already, unchanged since this process saved them."""
        self.reached: set[str] = set()
        """Stages a :meth:`wait` saw this save reach (should_save() trusts them at once,
        without waiting for its own watcher's answer)."""
        """jax arrays' device-to-host copy and the handoff, running after save() returned."""

    def copied(self) -> bool:
        """Whether the arrays are in shared memory and handed off (always, for numpy)."""
        return self._copy is None or self._copy.done()

    def wait_copied(self, timeout: float | None = None) -> None:
        """Block until the device-to-host copy and the handoff are done; raises
        :class:`SaveFailed` if they failed (the step was not saved)."""
        if self._copy is None:
            return
        try:
            self._copy.result(timeout)
        except FutureTimeout:
            raise TimeoutError(
                f"step {self.step} of job {self.job!r}: device-to-host copy still running "
                f"after {timeout} s"
            ) from None
        except CkptdError:
            raise
        except Exception as exc:
            raise SaveFailed(
                f"step {self.step} of job {self.job!r} was not saved: copying the arrays "
                f"failed: {exc!r}",
                "COPY",
            ) from exc

    def state(self) -> str:
        """Current state: COPYING (jax arrays going to host memory), STAGING, LOCAL,
        DRAINING, DURABLE, FAILED or SUPERSEDED."""
        if not self.copied():
            return "COPYING"
        self.wait_copied()
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
        self.wait_copied(timeout)
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
                self.reached.add(stage)
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
        status: pb.SaveStatus = self.connection.get_save_status(req, timeout + 30.0)
        return status

    def __repr__(self) -> str:
        return f"SaveHandle(job={self.job!r}, step={self.step})"


def watch_stage(handle: SaveHandle, stage: str, done: threading.Event) -> None:
    """Wait (server-side, in bounded calls) until a save reaches ``stage`` or ends."""
    try:
        handle.wait_copied()
        while True:
            st = handle._status(STAGES[stage], 30.0)
            if st.reached:
                handle.reached.add(stage)
            if st.reached or st.final:
                return
    except Exception:  # a background watcher must never die loudly
        return  # gone, unreachable or the client closed: the next save() reports it
    finally:
        done.set()


class Watchers:
    """Daemon threads (``ckptd-watch``) that run :func:`watch_stage` calls, kept for
    the next: ``Thread.start()`` waits until the new thread runs, which on a busy
    2-core host held a trainer's ``save()`` up by milliseconds. A thread is started
    only when none is idle (the first save's, or while earlier saves' watches last).
    One set per process, shared by its clients."""

    def __init__(self) -> None:
        self._reset()
        # A forked child has none of the parent's threads: it starts its own.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._queue: queue.SimpleQueue[tuple[SaveHandle, str, threading.Event]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._idle = 0

    def watch(self, handle: SaveHandle, stage: str, done: threading.Event) -> None:
        """Watch ``handle`` until it reaches ``stage`` or ends, then set ``done``."""
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that thread takes this watch
        self._queue.put((handle, stage, done))
        if start:
            threading.Thread(target=self._run, name="ckptd-watch", daemon=True).start()

    def _run(self) -> None:
        jobs, lock = self._queue, self._lock  # this process's, if it forks meanwhile
        while True:
            watch_stage(*jobs.get())
            with lock:
                self._idle += 1


WATCHERS = Watchers()
