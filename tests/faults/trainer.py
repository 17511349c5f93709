"""A small trainer that freezes at a named point so a test can SIGKILL it exactly there.

Run by test_trainer_kill.py as a subprocess::

    python tests/faults/trainer.py --socket S --job J --point P --marker M [--steps N] [--mib X]

The instrumentation is test-side only (no product hooks): it wraps
``ckptd.core.wire.Connection.call`` (every RPC of the client goes through it)
and a few client internals. When the kill point is reached the trainer writes
the marker file ``M`` atomically and blocks that thread forever, so the test
kills it at a known place instead of after a sleep.

Points (``NAME`` or ``NAME#N`` for the N-th occurrence, 1 by default):

- ``before:<RPC>`` / ``after:<RPC>``: before the request is sent / after its
  reply arrived, for ``AcquireLease``, ``CommitShards``, ``GetSaveStatus``,
  ``Restore``, ``ReleaseLease``, ``CheckCapacity``, ``ListCheckpoints``...
  Only calls of the trainer's own threads count: the client's watcher thread
  (``ckptd-watch``) long-polls ``GetSaveStatus`` on its own schedule, which
  would make the N-th call depend on thread timing.
- ``mid-copy``: the first array of a save is copied into the lease, the rest not.
- ``during-wait``: ``handle.wait("local")`` has a ``GetSaveStatus`` in flight at
  the daemon (the test keeps the write paused with a failpoint, so the daemon
  really is waiting on it).
- ``between-saves``: after the second save of the run was acknowledged.
- ``after-restore-holding-arrays``: restore() returned; its arrays are alive.
- ``save-2-of-3``: the lease of the second save is granted (``after:AcquireLease#2``).
- ``d2h`` (with ``--jax``): the device-to-host copy of the second jax save has
  copied its first array; ``save()`` returned before it (trusted jax arrays are
  copied on a client thread).
- ``none``: run to the end and exit 0 (a trainer resuming after the kill).

Protocol on stdout, one line each, flushed before the marker is written:
``RESTORED <step>`` (bit-exact against ``state_for``), ``RESTORE-LEASE <0|1>``
(the Restore reply lent a shared-memory segment), ``HANDED <step>`` (a
CommitShards reply arrived: the daemon owns the bytes), ``REPLIED <step>`` and
``WHOLE <step>`` (for a commit sent while the client copies: its reply arrived;
the word that the lease is whole was written; the daemon owns the bytes once
both are there), ``ACK <step>``
(``save()`` returned; for jax, once the copy and handoff are done too).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any, NoReturn

# Run as a script: make the repository root importable for tests.helpers.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from ckptd.client import CheckpointNotFound, Client, FixedInterval
from ckptd.client.handoff import Handoff
from ckptd.client.saver import Saver
from ckptd.core.wire import METADATA, Connection
from ckptd.proto import ckptd_pb2 as pb
from tests.helpers import state_for

WATCHER_THREAD = "ckptd-watch"
D2H_THREAD = "ckptd-d2h"
ALIASES = {"save-2-of-3": "after:AcquireLease#2", "d2h": "d2h#2"}

_out_lock = threading.Lock()


def emit(*words: object) -> None:
    """One protocol line on stdout, flushed (the test reads these, not the log)."""
    with _out_lock:
        sys.stdout.write(" ".join(str(w) for w in words) + "\n")
        sys.stdout.flush()


class KillPoint:
    """The one place this run stops at: parsed from ``NAME[#N]``."""

    def __init__(self, spec: str, marker: Path) -> None:
        spec = ALIASES.get(spec, spec)
        name, _, nth = spec.partition("#")
        self.name = name
        self.nth = int(nth) if nth else 1
        self.marker = marker
        self._seen: Counter[str] = Counter()
        self._lock = threading.Lock()

    def arrive(self, name: str) -> bool:
        """Count one occurrence of ``name``; True if it is the one to stop at."""
        if name != self.name:
            return False
        with self._lock:
            self._seen[name] += 1
            return self._seen[name] == self.nth

    def stop(self) -> NoReturn:
        """Tell the test we are there (atomically: it polls for the file), then hang.

        Only this thread hangs; every line printed so far is flushed, so what the
        test reads after the kill is exactly what was acknowledged before it."""
        tmp = self.marker.with_name(self.marker.name + ".tmp")
        tmp.write_text(f"{self.name}#{self.nth} pid {os.getpid()}\n")
        os.replace(tmp, self.marker)
        threading.Event().wait()
        raise AssertionError("unreachable")

    def at(self, name: str) -> None:
        """Stop here if ``name`` is the kill point's occurrence."""
        if self.arrive(name):
            self.stop()


def instrument(point: KillPoint) -> None:
    """Wrap the client's RPC funnel and copy routines with the kill point's checks."""
    original_call = Connection._unary
    original_copy = Saver.copy_arrays
    original_d2h = Saver._copy_device_and_commit
    original_mark = Handoff.mark
    local = threading.local()  # per d2h save: has its first array been copied yet?
    in_flight: list[Any] = []  # keeps the during-wait call alive (a dropped future cancels)

    def call(
        self: Connection,
        method: str,
        request: Any,
        response: Any,
        timeout: float | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Any:
        if threading.current_thread().name == WATCHER_THREAD:
            return original_call(self, method, request, response, timeout, metadata)
        point.at(f"before:{method}")
        waiting = method == "GetSaveStatus" and request.timeout_seconds > 0
        if waiting and point.arrive("during-wait"):
            # Start the long poll without waiting for it, then make one more call on
            # the same channel: its answer means the daemon has read the earlier
            # request (the HTTP/2 frames of one connection arrive in order).
            in_flight.append(
                self._stub.GetSaveStatus.future(
                    request, timeout=timeout or self.timeout, metadata=METADATA + metadata
                )
            )
            original_call(self, "GetStatus", pb.GetStatusRequest(), pb.DaemonStatus, None, ())
            point.stop()
        reply = original_call(self, method, request, response, timeout, metadata)
        if method == "CommitShards":
            # Sent once copied, the reply hands the save off; sent while copying, the
            # reply and the word that the lease is whole (WHOLE) do, together.
            emit("REPLIED" if request.copied_nonce else "HANDED", request.step)
        elif method == "Restore":
            emit("RESTORE-LEASE", int(reply.HasField("lease")))
        point.at(f"after:{method}")
        return reply

    def copy_into(self: Saver, mm: Any, entries: list[Any], arrays: dict[str, Any]) -> None:
        if threading.current_thread().name.startswith(D2H_THREAD):
            # The d2h path copies one array per call: count each save's first one.
            original_copy(self, mm, entries, arrays)
            if not getattr(local, "copied", True):
                local.copied = True
                point.at("d2h")
            return
        if entries and point.arrive("mid-copy"):
            original_copy(self, mm, entries[:1], arrays)  # one array in the lease, not the rest
            point.stop()
        original_copy(self, mm, entries, arrays)

    def mark(req: Any, mm: Any, whole: bool = True) -> None:
        original_mark(req, mm, whole)
        if whole:
            emit("WHOLE", req.step)

    def copy_device_and_commit(self: Saver, *args: Any) -> None:
        local.copied = False
        original_d2h(self, *args)

    Connection._unary = call  # type: ignore[method-assign]
    Saver.copy_arrays = copy_into  # type: ignore[method-assign]
    Saver._copy_device_and_commit = copy_device_and_commit  # type: ignore[method-assign,assignment]
    Handoff.mark = staticmethod(mark)  # type: ignore[method-assign]


def as_jax(tree: dict[str, np.ndarray]) -> dict[str, Any]:
    """The same state as jax arrays (saved, trusted, with a background device-to-host
    copy)."""
    import jax.numpy as jnp

    return {k: jnp.asarray(v) for k, v in tree.items()}


def restore_newest(client: Client, mib: int, point: KillPoint) -> tuple[int, Any]:
    """Restore the newest checkpoint, check it bit-exact; ``(step, tree)``, or (0, None)."""
    if not client.list():  # ListCheckpoints: a fresh job starts at step 0
        return 0, None
    try:
        tree, meta = client.restore()
    except CheckpointNotFound:
        return 0, None
    step = int(meta["step"])
    for key, want in state_for(step, mib).items():
        if np.asarray(tree[key]).tobytes() != want.tobytes():
            sys.exit(f"restored step {step}: array {key} differs from what was saved")
    emit("RESTORED", step)
    point.at("after-restore-holding-arrays")  # `tree` is alive: its segment is borrowed
    return step, tree


def main(argv: list[str] | None = None) -> int:
    """Restore if possible, then save ``--steps`` steps, stopping at ``--point``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--point", required=True)
    ap.add_argument("--marker", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mib", type=int, default=2)
    ap.add_argument("--jax", action="store_true", help="save jax arrays (d2h on a thread)")
    args = ap.parse_args(argv)
    point = KillPoint(args.point, args.marker)
    instrument(point)
    # FixedInterval(1): every step saves (given room), so the N-th call of each RPC is
    # the same in every run; Continuous() would skip steps whose predecessor is not
    # LOCAL yet, which depends on the daemon's timing.
    # --jax: trusted, so that CPU arrays take the path of an accelerator's, copied on a
    # client thread after save() returns (untrusted ones are copied before).
    client = Client(
        args.job, socket=args.socket, policy=FixedInterval(1), trust_jax_arrays=args.jax
    )
    start, restored = restore_newest(client, args.mib, point)
    for i, step in enumerate(range(start + 1, start + 1 + args.steps)):
        if not client.should_save(step):
            sys.exit(f"step {step}: should_save said no: {client.last_refusal}")
        state = state_for(step, args.mib)
        handle = client.save(step, as_jax(state) if args.jax else state, metadata={"step": step})
        handle.wait_copied()  # numpy: at once; jax: the background copy and handoff
        emit("ACK", step)
        if i % 2 == 0:  # wait every other step, so some saves are in flight at a kill
            handle.wait("local", timeout=120)
        if i == 1:
            point.at("between-saves")
    del restored
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
