"""Many nodes on one bucket: the S3 requests ckptd makes, by kind, per phase.

One SeaweedFS S3 server, the counting proxy (``proxy.py``) in front of it, and
``--nodes`` real ``ckptd serve`` daemons (each its own root, socket, node id and access
key, all pointed at the proxy). One job spans every node: node ``i`` runs rank ``i``
(``Client(job, rank=i, node_ranks=[i], world_size=N)``, driven from a thread here)
with a state of ``--state-kib`` in 4 float32 arrays. Phases, each counted on its own
(the proxy is reset before it, read once no request was in flight for
``--quiet-seconds``):

- ``startup-empty``: N daemons start on empty roots against an empty bucket prefix.
- ``step``: every rank saves step s and waits until DURABLE, for ``--steps`` steps.
- ``idle``: nothing for ``--idle-seconds`` (the daemons' periodic work).
- ``restart-intact``: every daemon stopped and started again on its root.
- ``restore-local``: every rank (a new Client) restores the newest step at once.
- ``restart-wiped``: every root and /dev/shm segment deleted (the whole job lost its
  nodes), every daemon started again: the start-up half of the mass restart.
- ``restore-wiped``: every rank restores the newest step at once, from the bucket: the
  herd. Latency per node (P50/P90/max) and the time to the first restored step.
- ``restart-renamed``, ``restore-renamed`` (unless ``--no-renamed``): the same, but
  every node comes back under a new name (node i as node N+i, as Kubernetes renames
  a replaced node): no node finds anything of its own in the bucket.

A table on stdout and ``bench/results/scale[-LABEL].json`` (every phase's counters,
per-node counts, key patterns, a per-second timeline, and an ``extrapolation`` to
1,000 and 10,000 nodes).

    .venv/bin/python bench/scale/run.py                # 64 nodes, 4 steps of 1 MiB per rank
    .venv/bin/python bench/scale/run.py --quick        # 8 nodes, 2 steps
    .venv/bin/python bench/scale/run.py --label new    # bench/results/scale-new.json
    .venv/bin/python bench/scale/report.py bench/results/scale-old.json bench/results/scale-new.json

Beside it: ``cluster.py`` (the daemons and clients), ``proxy.py`` and ``s3ops.py`` (the
counting proxy), ``report.py`` (tables, extrapolation, comparing two runs),
``check_proxy.py`` (the proxy against SeaweedFS with botocore, s3fs and presigned
ranged GETs).
"""

from __future__ import annotations

import argparse
import atexit
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # common
sys.path.insert(0, str(HERE.parents[1]))  # tests.servers
sys.path.insert(0, str(HERE))  # cluster, proxy, report (not bench/goodput's report)
from cluster import BUCKET, Nodes, Ranks, per_node_keys  # noqa: E402
from common import DEFAULT_WORK_DIR, print_table, run_directory, write_results  # noqa: E402
from proxy import ProxyProcess  # noqa: E402
from report import extrapolate, percentiles, print_report  # noqa: E402
from s3ops import LIST_KINDS  # noqa: E402

from tests.servers import SeaweedS3  # noqa: E402


def timing(results: list[dict[str, Any]], field: str) -> dict[str, Any]:
    """Percentiles of ``field`` over the ranks' results, and when the first one ended."""
    done = [r for r in results if field in r]
    out = percentiles([r[field] for r in done])
    if done:
        out["first_done_s"] = min(r["t1"] for r in done) - min(r["t0"] for r in results)
        out["all_done_s"] = max(r["t1"] for r in done) - min(r["t0"] for r in results)
    return out


def errors(results: list[dict[str, Any]]) -> list[str]:
    """The ranks' error messages."""
    return [x["error"] for x in results if "error" in x]


class Phases:
    """The phases in order, each counted on its own by the proxy."""

    def __init__(self, args: argparse.Namespace, proxy: ProxyProcess, nodes: Nodes) -> None:
        self.args, self.proxy, self.nodes = args, proxy, nodes
        self.ranks = Ranks(args, nodes)
        self.done: list[dict[str, Any]] = []

    def run(self) -> None:
        """Every phase, in order."""
        self.phase("startup-empty", lambda: {"startup": self.nodes.start()})
        self.phase("step", self.steps, steps=self.args.steps)
        if self.args.idle_seconds > 0:
            self.phase("idle", self.idle)
        self.phase("restart-intact", lambda: self.restart(wipe=False))
        self.phase("restore-local", self.restore)
        self.phase("restart-wiped", lambda: self.restart(wipe=True))
        self.phase("restore-wiped", self.restore)
        if self.args.renamed:
            self.phase("restart-renamed", lambda: self.restart(wipe=True, rename=True))
            self.phase("restore-renamed", self.restore)

    def phase(self, name: str, fn: Callable[[], dict[str, Any]], steps: int = 1) -> None:
        """Reset the counters, run ``fn``, wait for quiet, keep the counts."""
        self.proxy.reset()
        t0 = time.monotonic()
        extra = fn()
        quiet = self.proxy.wait_quiet(self.args.quiet_seconds, self.args.timeout)
        ph = {"name": name, "steps": steps, "seconds": time.monotonic() - t0, **extra}
        ph.update(quiet=quiet, counts=self.proxy.snapshot())
        self.done.append(ph)
        total, took = ph["counts"]["total"], ph["seconds"]
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {total} requests in {took:.1f} s", flush=True)

    def steps(self) -> dict[str, Any]:
        """Every rank saves each step to DURABLE; per-step counts from cumulative ones."""
        per_step: list[dict[str, Any]] = []
        before: dict[str, int] = {}
        for s in range(1, self.args.steps + 1):
            res = self.ranks.save(s)
            self.proxy.wait_quiet(self.args.quiet_seconds, self.args.timeout)
            now = {k: v["count"] for k, v in self.proxy.snapshot()["kinds"].items()}
            per_step.append({
                "step": s,
                "save_s": timing(res, "save_s"),
                "durable_s": timing(res, "durable_s"),
                "counts": {k: c - before.get(k, 0) for k, c in now.items()},
                "errors": errors(res),
            })  # fmt: skip
            before = now
        return {"per_step": per_step, "errors": [e for s in per_step for e in s["errors"]]}

    def idle(self) -> dict[str, Any]:
        """Nothing but the daemons' own periodic work."""
        time.sleep(self.args.idle_seconds)
        return {}

    def restart(self, wipe: bool, rename: bool = False) -> dict[str, Any]:
        """Stop every daemon (and wipe its node, ``rename`` it), start them all again."""
        self.ranks.close()
        stopped = self.nodes.stop()
        if wipe:
            self.nodes.wipe(rename)
        at_stop = self.proxy.reset()  # the stops' requests, kept apart
        stop_counts = {k: v["count"] for k, v in at_stop["kinds"].items()}
        return {"stop_s": stopped, "stop_counts": stop_counts, "startup": self.nodes.start()}

    def restore(self) -> dict[str, Any]:
        """Every rank (a new client) restores the newest step at once."""
        res = self.ranks.restore()
        return {
            "restore": timing(res, "restore_s"),
            "errors": errors(res),
            "restored_steps": sorted({x["step"] for x in res if "step" in x}),
            "mismatches": sum(1 for x in res if x.get("ok") is False),
            "wrong_step": sum(1 for x in res if "step" in x and x["step"] != self.args.steps),
        }


def run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """Start the server, the proxy and the daemons, run the phases, stop everything."""
    s3 = SeaweedS3(run_dir / "seaweed")
    proxy: ProxyProcess | None = None
    nodes: Nodes | None = None
    phases: Phases | None = None
    failure = None
    try:
        if not args.shared_key:
            per_node_keys(s3, 2 * args.nodes)
        s3.start()
        s3.make_bucket(BUCKET)
        proxy = ProxyProcess(s3.endpoint_url, run_dir / "proxy.log").start()
        nodes = Nodes(args, run_dir, s3, proxy.url)
        atexit.register(nodes.close)
        phases = Phases(args, proxy, nodes)
        phases.run()
    except Exception as exc:  # keep the phases done so far
        if phases is None or not phases.done:
            raise
        failure = "".join(traceback.format_exception(exc))
        print(f"run stopped early:\n{failure}", file=sys.stderr)
    finally:
        if phases is not None:
            phases.ranks.close()
        if nodes is not None:
            nodes.close()
        if proxy is not None:
            proxy.stop()
        s3.close()
    assert phases is not None and nodes is not None
    return {"phases": phases.done, "daemon_command": nodes.command, "failure": failure}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=64, help="daemons, one rank each (64)")
    p.add_argument("--steps", type=int, default=4, help="steps saved to DURABLE (4)")
    p.add_argument("--state-kib", type=int, default=1024, help="state per rank, KiB (1024)")
    p.add_argument("--label", help="write bench/results/scale-LABEL.json")
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR / "scale")
    p.add_argument("--quick", action="store_true", help="8 nodes, 2 steps, 10 s idle")
    p.add_argument("--idle-seconds", type=float, default=35.0, help="idle phase (35; 0: none)")
    p.add_argument(
        "--quiet-seconds",
        type=float,
        default=3.0,
        help="a phase ends once no request began or ended for this long (3)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per save / phase wait (600 s)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="daemon start-up (600 s)")
    p.add_argument("--retention-local", default="KeepLatest(2)")
    p.add_argument("--retention-remote", default="KeepLatest(3)")
    p.add_argument("--daemon-args", default="", help="more `ckptd serve` flags (one string)")
    p.add_argument(
        "--shared-key",
        action="store_true",
        help="one access key for all nodes (no per-node attribution)",
    )
    p.add_argument("--no-renamed", dest="renamed", action="store_false",
                   help="skip the phases where every node comes back under a new name")  # fmt: skip
    p.add_argument("--keep", action="store_true", help="keep the run dir (daemon logs)")
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.steps, args.idle_seconds = 8, 2, min(args.idle_seconds, 10.0)
    return args


def main() -> None:
    """Run every phase, print the tables, write the JSON."""
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks run
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    print(f"scale: {args.nodes} nodes, {args.steps} steps of {args.state_kib} KiB per rank")
    if args.keep:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        run_dir = args.work_dir / f"scale-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir.mkdir()
        results = run(args, run_dir)
        print(f"kept {run_dir}")
    else:
        with run_directory(args.work_dir, "scale") as run_dir:
            results = run(args, run_dir)
    results["extrapolation"] = extrapolate(results["phases"], args.nodes, list(LIST_KINDS))
    print_report(results, args.nodes, print_table)
    name = f"scale-{args.label}" if args.label else "scale"
    path = write_results(name, {"config": config, **results}, args.work_dir)
    print(f"\nwrote {path}")
    bad = [ph["name"] for ph in results["phases"]
           if ph.get("errors") or ph.get("mismatches") or ph.get("wrong_step")
           or not ph["quiet"]]  # fmt: skip
    if bad or results["failure"]:
        print(f"errors, mismatches or no quiet in: {', '.join(bad) or '-'}; "
              f"stopped early: {'yes' if results['failure'] else 'no'}")  # fmt: skip
        sys.exit(1)


if __name__ == "__main__":
    main()
