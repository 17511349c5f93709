"""One way to run a real ``ckptd serve`` process from Python: ``ckptd demo``, the tests
and the benchmarks all start their daemons with :class:`DaemonProcess`.

It waits for readiness on the socket (``GetStatus`` answers), stops with SIGTERM
(SIGKILL after a timeout), and gives tests what they synchronise on instead of
sleeps and log text: the daemon's status, its step events (``ListEvents``, which
can wait server-side for the next one), and failpoints armed with ``pause``
that block inside the daemon until the caller releases them (daemon/faults.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from ckptd.core.errors import Unavailable
from ckptd.core.wire import Connection
from ckptd.proto import ckptd_pb2 as pb

from .. import faults

MAX_SOCKET_PATH = 99
"""Unix socket paths are limited to 107 bytes (the session socket's name adds 8); longer
ones go to a short temp dir."""


def ckptd_command() -> list[str]:
    """The command that runs the ``ckptd`` CLI of the running interpreter."""
    script = Path(sys.executable).parent / "ckptd"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "ckptd.daemon"]


class DaemonProcess:
    """A ``ckptd serve`` subprocess on ``root``; use as a context manager or start/stop.

    ``extra_args`` are appended to ``ckptd serve`` (later flags win), ``env`` is added
    to this process's environment (bucket credentials, ``CKPTD_FAILPOINTS``). The log
    is appended to ``log_path`` across restarts.
    """

    def __init__(
        self,
        root: Path,
        socket: Path | None = None,
        *,
        node_id: str | None = None,
        staging_budget: str = "512MiB",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        self.root = Path(root)
        self._tmp = Path(tempfile.mkdtemp(prefix="ck", dir="/tmp"))
        if socket is None or len(str(socket).encode()) > MAX_SOCKET_PATH:
            socket = self._tmp / "run" / "ckptd.sock"
        self.socket = Path(socket)
        self.log = Path(log_path) if log_path else self.root.parent / f"{self.root.name}.log"
        self.node_id = node_id
        self.staging_budget = staging_budget
        self.extra_args = list(extra_args)
        self.env: dict[str, str] = dict(env or {})
        self.failpoint_dir = self._tmp / "failpoints"
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None

    # -- the process ---------------------------------------------------------------
    def command(self) -> list[str]:
        """The ``ckptd serve`` command line."""
        node = ["--node-id", self.node_id] if self.node_id else []
        return [
            *ckptd_command(),
            "serve",
            "--root",
            str(self.root),
            "--socket",
            str(self.socket),
            *node,
            "--staging-budget-bytes",
            self.staging_budget,
            # Several daemons share a host here (tests, benchmarks): each its own port.
            "--metrics-address",
            "127.0.0.1:0",
            *self.extra_args,
        ]

    def start(self, wait: bool = True) -> DaemonProcess:
        """Start the process (and wait until it answers on its socket)."""
        env = {**os.environ, **self.env}
        env.pop("CKPTD_CONFIG", None)
        env[faults.DIR_VARIABLE] = str(self.failpoint_dir)
        shutil.rmtree(self.failpoint_dir, ignore_errors=True)
        self.failpoint_dir.mkdir(parents=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        log: IO[bytes]
        with open(self.log, "ab") as log:  # appended to: a restart keeps the earlier lines
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env
            )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Poll the socket until the daemon answers ``GetStatus``."""
        deadline = time.monotonic() + (timeout or self.start_timeout)
        probe = Connection(self.socket, timeout=5.0)
        try:
            while True:
                try:
                    probe.get_status(pb.GetStatusRequest())
                    return
                except Unavailable:
                    assert self.proc is not None
                    if self.proc.poll() is not None:
                        raise RuntimeError(
                            f"ckptd serve exited with status {self.proc.returncode} during "
                            f"start-up:\n{self.log_tail()}"
                        ) from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"ckptd serve did not answer on {self.socket}:\n{self.log_tail()}"
                        ) from None
                    time.sleep(0.05)
        finally:
            probe.close()

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM and wait (SIGKILL after ``timeout``); returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: no chance to clean up."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def restart(self) -> DaemonProcess:
        """Start a fresh process on the same root and socket."""
        return self.start()

    def running(self) -> bool:
        """Whether the process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        """Stop the process if it runs and remove the temporary directory."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self.running():
            self.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what callers synchronise on ---------------------------------------------------
    @property
    def connection(self) -> Connection:
        """A connection to the daemon (kept open across restarts: gRPC reconnects)."""
        if self._conn is None:
            self._conn = Connection(self.socket, timeout=60.0)
        return self._conn

    def status(self) -> pb.DaemonStatus:
        """``GetStatus``."""
        status: pb.DaemonStatus = self.connection.get_status(pb.GetStatusRequest())
        return status

    def events(self, job: str = "", after: int = 0, wait: float = 0.0) -> list[pb.EventRecord]:
        """Step events newer than ``after`` (waiting up to ``wait`` s for one)."""
        req = pb.ListEventsRequest(job=job, after_seq=after, wait_seconds=wait)
        resp: pb.ListEventsResponse = self.connection.list_events(req, wait + 60.0)
        return list(resp.events)

    def wait_event(
        self,
        match: Callable[[pb.EventRecord], bool],
        *,
        job: str = "",
        after: int = 0,
        timeout: float = 60.0,
    ) -> pb.EventRecord:
        """The first event newer than ``after`` for which ``match(event)`` is true, waiting
        for it (server-side) up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no matching event after #{after} within {timeout} s")
            for e in self.events(job, after, min(left, 20.0)):
                if match(e):
                    return e
                after = e.seq

    def metrics_url(self, path: str = "/metrics") -> str:
        """``http://HOST:PORT/metrics`` (or another path) of this daemon's HTTP endpoint."""
        address = self.status().metrics_address
        if not address:
            raise RuntimeError("this daemon serves no metrics (metrics_address is off)")
        return f"http://{address}{path}"

    def wait_failpoint(self, name: str, timeout: float = 60.0) -> None:
        """Block until the daemon reached failpoint ``name`` (armed with ``pause``)."""
        faults.wait_hit(self.failpoint_dir, name, timeout, alive=self.running)

    def release(self, name: str) -> None:
        """Let a daemon paused at failpoint ``name`` go on."""
        faults.release(self.failpoint_dir, name)

    def log_text(self) -> str:
        """What the daemon logged so far (for failure messages, not as an oracle)."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log."""
        return "\n".join(self.log_text().splitlines()[-lines:])


def event_is(kind: int, step: int | None = None) -> Callable[[pb.EventRecord], bool]:
    """A matcher for :meth:`DaemonProcess.wait_event`: this kind (of this step)."""
    return lambda e: e.kind == kind and (step is None or e.step == step)
