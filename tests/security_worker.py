"""One client action, run as another user by tests/test_security.py.

Usage: ``python security_worker.py SOCKET ACTION ARGS...``; prints one JSON line:
``{"ok": true, ...}`` or ``{"error": STATUS, "message": ...}``. The ``hold-lease``
action prints the lease it got and keeps it until stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

from ckptd.client import Client
from ckptd.client import orbax as ckptd_orbax
from ckptd.core.errors import CkptdError
from ckptd.proto import ckptd_pb2 as pb


def act(client: Client, action: str, args: list[str]) -> dict[str, Any]:
    conn = client.connection
    if action == "save":
        client.save(int(args[0]), {"w": np.arange(4096, dtype=np.float32)}).wait("local")
        return {}
    if action == "restore":
        state, _ = client.restore()
        return {"sum": float(np.asarray(state["w"]).sum())}
    if action == "restore-files":  # the path where the client opens rank files itself
        state, _ = client.restore(shared_memory=False)
        return {"sum": float(np.asarray(state["w"]).sum())}
    if action == "status":
        st = conn.get_save_status(pb.GetSaveStatusRequest(job=client.job, step=int(args[0])))
        return {"state": st.state}
    if action == "list":
        resp = conn.list_checkpoints(pb.ListCheckpointsRequest())
        return {"jobs": sorted({c.job for c in resp.checkpoints})}
    if action == "pin":
        conn.pin(pb.PinRequest(job=client.job, step=int(args[0]), pinned=True))
        return {}
    if action == "adopt":
        conn.adopt(pb.AdoptRequest(job=client.job, step=int(args[0]), path=args[1]))
        return {}
    if action == "watch":
        return {"directory": str(ckptd_orbax.directory(client, args[0]))}
    if action == "ensure":
        req = pb.EnsureLocalRequest(job=client.job, directory=args[0])
        return {"path": conn.ensure_local(req).path}
    if action == "orbax-step":  # a finished Orbax-like step directory, written as us
        step = os.path.join(args[0], args[1])
        os.makedirs(step)
        with open(os.path.join(step, "data"), "w") as f:
            f.write("b's weights")
        with open(os.path.join(step, "commit_success.txt"), "w") as f:
            f.write("ok")
        return {}
    if action == "remove-step":
        import shutil

        shutil.rmtree(os.path.join(args[0], args[1]))
        return {}
    if action == "read":
        with open(args[0]) as f:
            return {"text": f.read(), "uid": os.fstat(f.fileno()).st_uid}
    if action == "open-shm":  # by name, as a process that was not granted it
        try:
            os.close(os.open(os.path.join("/dev/shm", args[0]), os.O_RDWR))
        except OSError as exc:
            return {"errno": exc.errno}
        return {"errno": 0}
    if action == "open-lease":  # over our own session: a lease another process holds
        os.close(conn.session.open_lease(args[0]))
        return {}
    if action == "commit-foreign":  # commit someone else's lease into our job
        req = pb.CommitShardsRequest(job=client.job, step=1, rank=0, lease_id=args[0])
        req.node_ranks.append(0)
        req.world_size = 1
        conn.commit_shards(req)
        return {}
    if action == "hold-lease":
        lease = conn.acquire_lease(pb.AcquireLeaseRequest(job=client.job, size_bytes=4096))
        print(json.dumps({"lease_id": lease.lease_id, "segment": lease.segment}), flush=True)
        sys.stdin.read()
        return {}
    raise SystemExit(f"unknown action {action}")


def main() -> None:
    socket, action, job, *args = sys.argv[1:]
    client = Client(job, socket=socket, reconnect_timeout=5.0)
    try:
        out: dict[str, Any] = {"ok": True, **act(client, action, args)}
    except CkptdError as exc:
        out = {"error": exc.code, "message": str(exc)}
    finally:
        client.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
