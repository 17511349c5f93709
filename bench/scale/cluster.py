"""The nodes of ``run.py``: N ``ckptd serve`` daemons on one bucket, one client each.

Node i is ``node-<i>`` (also its S3 access key, so the proxy can tell the nodes apart),
with its own root, socket and log; rank i of the job lives on it. Imported by
``run.py`` once ``bench/`` and the repository root are on ``sys.path``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import shutil
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from report import percentiles

from ckptd.client import Client
from ckptd.daemon.app.launcher import DaemonProcess
from ckptd.daemon.local.segments import recorded_dir
from tests.servers import SeaweedS3

BUCKET = "ckptd-scale"
PREFIX = "ckptd"
JOB = "scale"
ARRAYS = 4


def node_id(i: int) -> str:
    """Node ``i``'s id, also its S3 access key (how the proxy tells the nodes apart)."""
    return f"node-{i:04d}"


def make_state(rank: int, step: int, kib: int) -> dict[str, Any]:
    """Rank ``rank``'s state at ``step``: ``ARRAYS`` float32 arrays, ``kib`` KiB in all."""
    rng = np.random.default_rng([rank, step])
    n = max(1, kib * 1024 // 4 // ARRAYS)
    return {**{f"w{j}": rng.random(n, dtype=np.float32) for j in range(ARRAYS)}, "step": step}


def state_matches(tree: Any, rank: int, step: int, kib: int) -> bool:
    """Whether a restored tree is exactly ``make_state(rank, step, kib)``."""
    want = make_state(rank, step, kib)
    return tree.get("step") == step and all(
        np.array_equal(np.asarray(tree[k]), want[k]) for k in want if k != "step"
    )


class Nodes:
    """The N daemons: start, stop, wipe together."""

    def __init__(self, args: argparse.Namespace, run_dir: Path, s3: SeaweedS3, url: str):
        env = {**s3.env(), "AWS_ENDPOINT_URL_S3": url, "AWS_ENDPOINT_URL": url}
        budget = f"{max(16 * 2**20, 8 * args.state_kib * 1024)}"
        flags = (
            f"--remote s3://{BUCKET}/{PREFIX} --remote-endpoint-url {url} --metrics-address off "
            "--part-size-bytes 5MiB --drain-concurrency 2 --write-workers 1 "
            "--local-low-watermark 1GiB --local-floor 256MiB "
            f"--retention-local {shlex.quote(args.retention_local)} "
            f"--retention-remote {shlex.quote(args.retention_remote)} {args.daemon_args}"
        )
        common = shlex.split(flags)
        self.daemons: list[DaemonProcess] = []
        for i in range(args.nodes):
            node_env = dict(env)
            if not args.shared_key:
                node_env["AWS_ACCESS_KEY_ID"] = node_id(i)
            self.daemons.append(
                DaemonProcess(
                    run_dir / "nodes" / node_id(i),
                    node_id=node_id(i),
                    staging_budget=budget,
                    extra_args=common,
                    env=node_env,
                    log_path=run_dir / "logs" / f"{node_id(i)}.log",
                    start_timeout=args.start_timeout,
                )
            )
        self.command = self.daemons[0].command()

    def start(self) -> dict[str, Any]:
        """Start every daemon at once; wait until all answer. Returns the timings."""
        t0 = time.monotonic()
        for d in self.daemons:
            d.start(wait=False)
        ready: list[float] = []

        def wait(d: DaemonProcess) -> None:
            d.wait_ready()
            ready.append(time.monotonic() - t0)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(wait, self.daemons))
        return {"all_ready_s": time.monotonic() - t0, "ready_s": percentiles(ready)}

    def stop(self, close: bool = False) -> float:
        """SIGTERM every daemon, then wait for each (``close``: and remove its temp dir);
        returns the seconds it took."""
        t0 = time.monotonic()
        for d in self.daemons:
            if d.running():
                assert d.proc is not None
                d.proc.send_signal(signal.SIGTERM)
        for d in self.daemons:
            with contextlib.suppress(Exception):
                d.close() if close else d.stop(60.0)
        return time.monotonic() - t0

    def wipe(self, rename: bool = False) -> None:
        """Every node lost its disk and shared memory (the daemons must be stopped);
        ``rename``: node i comes back as node N+i (with that access key)."""
        for i, d in enumerate(self.daemons):
            if rename:
                d.node_id = node_id(len(self.daemons) + i)
                if "AWS_ACCESS_KEY_ID" in d.env:  # not with --shared-key
                    d.env["AWS_ACCESS_KEY_ID"] = d.node_id
            seg_dir = recorded_dir(d.root)  # named in the root: read it first
            shutil.rmtree(d.root, ignore_errors=True)
            if seg_dir is not None:
                shutil.rmtree(seg_dir, ignore_errors=True)

    def close(self) -> None:
        """Stop everything and remove the daemons' temp dirs."""
        self.stop(close=True)


class Ranks:
    """One client per node, driven from a thread each."""

    def __init__(self, args: argparse.Namespace, nodes: Nodes) -> None:
        self.args = args
        self.nodes = nodes
        self.clients: list[Client | None] = [None] * args.nodes
        self.pool = ThreadPoolExecutor(args.nodes, thread_name_prefix="rank")

    def client(self, i: int) -> Client:
        c = self.clients[i]
        if c is None:
            sock = self.nodes.daemons[i].socket
            n, t = self.args.nodes, self.args.timeout
            c = Client(JOB, socket=sock, rank=i, node_ranks=[i], world_size=n, timeout=t)
            self.clients[i] = c
        return c

    def all(
        self, fn: Callable[[int, Any], dict[str, Any]], prep: Callable[[int], Any] = lambda i: None
    ) -> list[dict[str, Any]]:
        """``fn(i, prep(i))`` for every rank ``i``, each in its thread, all released at once
        (``prep`` runs before, untimed)."""
        for i in range(self.args.nodes):
            self.client(i)
        start = threading.Barrier(self.args.nodes)

        def one(i: int) -> dict[str, Any]:
            try:
                prepared = prep(i)
            finally:
                start.wait(self.args.timeout)
            t0 = time.monotonic()
            try:
                out = fn(i, prepared)
            except Exception as exc:
                out = {"error": f"rank {i}: {type(exc).__name__}: {exc}"}
            return {"t0": t0, "t1": time.monotonic(), **out}

        return list(self.pool.map(one, range(self.args.nodes)))

    def save(self, step: int) -> list[dict[str, Any]]:
        """Every rank saves ``step`` and waits until it is DURABLE."""
        kib, timeout = self.args.state_kib, self.args.timeout

        def one(i: int, state: dict[str, Any]) -> dict[str, Any]:
            t0 = time.monotonic()
            h = self.client(i).save(step, state)
            returned = time.monotonic() - t0
            h.wait("durable", timeout=timeout)
            return {"save_s": returned, "durable_s": time.monotonic() - t0}

        return self.all(one, lambda i: make_state(i, step, kib))

    def restore(self) -> list[dict[str, Any]]:
        """Every rank restores the newest step at once; each tree is checked after."""
        kib = self.args.state_kib

        def one(i: int, _: Any) -> dict[str, Any]:
            t0 = time.monotonic()
            tree, _meta = self.client(i).restore()
            took = time.monotonic() - t0
            step = int(tree.get("step", -1))
            ok = state_matches(tree, i, step, kib)
            del tree
            return {"restore_s": took, "step": step, "ok": ok}

        return self.all(one)

    def close(self) -> None:
        """Close every client (before their daemons stop)."""
        for i, c in enumerate(self.clients):
            if c is not None:
                with contextlib.suppress(Exception):
                    c.close()
            self.clients[i] = None


def per_node_keys(s3: SeaweedS3, n: int) -> None:
    """Give node i its own access key (``node_id(i)``): one identity, many credentials."""
    creds = [{"accessKey": s3.access_key, "secretKey": s3.secret_key}]
    creds += [{"accessKey": node_id(i), "secretKey": s3.secret_key} for i in range(n)]
    doc = {
        "identities": [
            {
                "name": "admin",
                "credentials": creds,
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    s3.s3_config.write_text(json.dumps(doc))
