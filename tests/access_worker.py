"""One client action, run as another user by tests/test_trust_access.py.

Usage: ``python access_worker.py SOCKET ACTION JOB ARGS...``; prints one JSON line
per answer: ``{"ok": true, ...}`` or ``{"error": STATUS, "message": ...}``. The
actions of tests/security_worker.py work here too; the ``hold-*``, ``flock`` and
``sessions`` actions print what they got and keep it until stdin closes;
``save-again`` saves, then saves the next step once told (a line on stdin).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from security_worker import act as security_act

from ckptd.client import Client
from ckptd.client.handoff import Liveness
from ckptd.core.errors import CkptdError
from ckptd.core.session import Session
from ckptd.proto import ckptd_pb2 as pb


def say(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


def act(client: Client, socket: str, action: str, args: list[str]) -> dict[str, Any]:
    conn = client.connection
    if action == "acquire":  # a lease of args[0] bytes, given back at once
        req = pb.AcquireLeaseRequest(job=client.job, size_bytes=int(args[0]))
        conn.release_lease(pb.ReleaseLeaseRequest(lease_id=conn.acquire_lease(req).lease_id))
        return {}
    if action == "hold-live":  # a lease named with this process's liveness file
        liveness = Liveness()
        req = pb.AcquireLeaseRequest(job=client.job, size_bytes=4096)
        lease = conn.acquire_lease(req, 30.0, liveness.metadata())
        say({"ok": True, "lease_id": lease.lease_id, "holder": liveness.name})
        if sys.stdin.readline().strip() == "close-session":
            conn.session.reset()  # the process lives on, with no session
            say({"ok": True})
        sys.stdin.read()
        os._exit(0)  # the liveness file stays behind, as after a crash
    if action == "save-again":  # a trainer that saved once and lives on; saves when told
        security_act(client, "save", [args[0]])
        say({"ok": True})
        sys.stdin.readline()
        client.staging_timeout = float(args[1])
        return security_act(client, "save", [str(int(args[0]) + 1)])
    if action == "prefetch":
        conn.prefetch(pb.PrefetchRequest(job=client.job))
        return {}
    if action == "flock":  # lock a file in /dev/shm by name, as any user may try
        fd = os.open(os.path.join("/dev/shm", args[0]), os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        say({"ok": True})
        sys.stdin.read()
        return {}
    if action == "sessions":  # open args[0] sessions, report each, keep them open
        got: list[str] = []
        held = []
        for _ in range(int(args[0])):
            s = Session(socket)
            try:
                s.metadata()
                got.append("ok")
                held.append(s)
            except CkptdError as exc:
                got.append(f"{exc.code}: {exc}")
        say({"ok": True, "sessions": got})
        sys.stdin.read()
        return {}
    return security_act(client, action, args)


def main() -> None:
    socket, action, job, *args = sys.argv[1:]
    client = Client(job, socket=socket, reconnect_timeout=5.0)
    try:
        out: dict[str, Any] = {"ok": True, **act(client, socket, action, args)}
    except CkptdError as exc:
        out = {"error": exc.code, "message": str(exc)}
    finally:
        client.close()
    say(out)


if __name__ == "__main__":
    main()
