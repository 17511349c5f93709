"""Trainers the checker runs as processes of their own: one SIGKILLed mid-save
(trainer.py), and one per test user, to check that no uid sees another's job
(users.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAINER = Path(__file__).with_name("trainer.py")
KILL_POINTS = ("mid-copy", "before:CommitShards", "after:CommitShards", "acked")
"""Where a killed trainer stops: before its save is whole (``mid-copy``, before the
commit is sent), when it may or may not be (the commit's reply arrived), after
``save()`` returned (``acked``: the daemon owns the bytes, the save must commit)."""
MARKER_TIMEOUT = 60.0


def kill_mid_save(
    socket: Path,
    job: str,
    step: int,
    sid: int,
    flavor: str,
    versions: tuple[int, ...],
    point: str,
) -> str:
    """Run a trainer that saves ``step`` and SIGKILL it at ``point``; returns what it
    printed (its ``ACK`` line says ``save()`` returned)."""
    with tempfile.TemporaryDirectory(prefix="ckmodel-kill-") as tmp:
        marker = Path(tmp) / "marker"
        out = Path(tmp) / "out"
        args = [str(socket), job, str(step), str(sid), flavor, ",".join(map(str, versions))]
        with open(out, "wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, str(TRAINER), *args, point, str(marker)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env={k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")},
            )
        try:
            deadline = time.monotonic() + MARKER_TIMEOUT
            while not marker.exists():
                if proc.poll() is not None:
                    raise AssertionError(
                        f"the trainer exited ({proc.returncode}) before reaching {point}:\n"
                        + out.read_text(errors="replace")[-3000:]
                    )
                if time.monotonic() > deadline:
                    raise AssertionError(f"the trainer did not reach {point} in time")
                time.sleep(0.01)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        return out.read_text(errors="replace")


USERS = ("ckptd-ta", "ckptd-tb")
"""The test users (tests/test_security.py makes them, in the socket group GROUP)."""
GROUP = "ckptd-clients"
USER_WORKER = Path(__file__).with_name("user_worker.py")
ANSWER_TIMEOUT = 180.0
"""Longer than any wait of the worker's own (its save waits 120 s for LOCAL): a worker
that stops answering is stuck, not slow."""


def users_available() -> str:
    """ "" when the test users exist (made here as root) and may run the worker; else
    why not (the machine's user operations then do nothing)."""
    import pytest

    from ..test_security import _ensure_users, _python

    try:
        _ensure_users()
        _python()
    except pytest.skip.Exception as exc:
        return str(exc)
    return ""


class User:
    """A trainer process running as one of the test users (user_worker.py)."""

    def __init__(self, name: str, socket: Path) -> None:
        from ..test_security import _python, as_user

        self.name = name
        # Its stderr, read back when it stops answering (a crash, a stack dump).
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            **as_user(name, [*_python(), str(USER_WORKER), str(socket)]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )

    def ask(self, **request: object) -> dict[str, object]:
        """One request's answer (user_worker.py); a worker that does not answer fails."""
        import json
        import select

        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], ANSWER_TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise AssertionError(
                f"{self.name}'s trainer gave no answer to {request}: {self._why()}"
            )
        answer: dict[str, object] = json.loads(line)
        return answer

    def _why(self) -> str:
        """What a worker that gave no answer left: its exit status, or its threads'
        stacks (it dumps them on SIGUSR1), and the tail of its stderr."""
        code = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(2)  # the dump is written at once; it goes on running
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace")[-4000:]
        state = "still running" if code is None else f"exited with {code}"
        return f"it is {state}; its stderr ends:\n{tail}"

    def close(self) -> None:
        """Stdin closed: the worker exits (killed if it does not)."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.stderr.close()
