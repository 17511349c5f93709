"""A trainer running as another user, driven by the checker over stdin and stdout.

    python tests/model/user_worker.py SOCKET

One JSON request a line, one JSON answer a line: ``{"ok": true, ...}`` or
``{"error": "<class>", "message": "..."}``. Requests:

- ``{"op": "save", "job", "step", "sid", "versions"}``: save and wait for LOCAL;
- ``{"op": "list", "job"}``: the steps ``ListCheckpoints`` shows (``job`` "" for all),
  as ``[job, step]`` pairs;
- ``{"op": "restore", "job", "step"}``: ``{"sid", "versions"}`` of the restored bytes
  (``versions`` null when they are no version's);
- ``{"op": "ls", "job"}``: what ``ckptd ls JOB`` prints, both streams (its hints).
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from ckptd.client import CkptdError, Client, FixedInterval
from ckptd.proto import ckptd_pb2 as pb
from tests.model.trees import KEYS, Arrays, content, leaf_bytes


def versions_of(tree: Any) -> list[int] | None:
    """The version each array's bytes are, None if any is no version's."""
    out = []
    for key in KEYS:
        got = leaf_bytes(tree[key])
        match = [v for v in range(8) if content(key, v).tobytes() == got]
        if not match:
            return None
        out.append(match[0])
    return out


def act(socket: str, clients: dict[str, Client], req: dict[str, Any]) -> dict[str, Any]:
    """One request's answer."""
    op, job = req["op"], req.get("job", "")
    if op == "ls":
        from ckptd.daemon.app import cli

        out, err = io.StringIO(), io.StringIO()
        streams = contextlib.redirect_stdout(out), contextlib.redirect_stderr(err)
        with streams[0], streams[1], contextlib.suppress(SystemExit):
            cli.main(["ls", job, "--socket", socket])
        return {"ok": True, "text": out.getvalue() + err.getvalue()}
    if job not in clients:
        clients[job] = Client(job or "-", socket=socket, policy=FixedInterval(1))
    client = clients[job]
    if op == "save":
        arrays = Arrays("numpy", tuple(req["versions"]))
        handle = client.save(req["step"], arrays.tree(), metadata={"sid": req["sid"]})
        handle.wait("local", timeout=120)
        return {"ok": True}
    if op == "list":
        resp = client.connection.list_checkpoints(pb.ListCheckpointsRequest(job=job))
        return {"ok": True, "steps": [[c.job, c.step] for c in resp.checkpoints if c.tiers]}
    if op == "restore":
        tree, meta = client.restore(step=req.get("step"))
        return {"ok": True, "sid": meta.get("sid"), "versions": versions_of(tree)}
    raise ValueError(f"unknown op {op!r}")


def main(argv: list[str]) -> int:
    """Answer requests until stdin closes."""
    socket = argv[0]
    faulthandler.register(signal.SIGUSR1)  # the checker's look at a worker gone quiet
    clients: dict[str, Client] = {}
    for line in sys.stdin:
        try:
            answer = act(socket, clients, json.loads(line))
        except CkptdError as exc:
            answer = {"error": type(exc).__name__, "message": str(exc)}
        except Exception as exc:  # a wait that timed out, a bug: the checker says which
            answer = {"error": type(exc).__name__, "message": str(exc), "unexpected": True}
        print(json.dumps(answer), flush=True)
    for c in clients.values():
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
