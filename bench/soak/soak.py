"""Soak: many clients save to one real daemon for minutes; does the daemon stay flat?

One ``ckptd serve`` (a ``file://`` remote in the run dir, so the drain runs too) and
``--clients`` worker processes, each its own job with one rank, saving a ``--mib`` MiB
state in ``--tensors`` arrays in a loop for ``--minutes``. Every 4th save waits for
LOCAL, and for the three before it. The parent samples the daemon's RSS, fds, threads,
staging memory, /dev/shm segments, catalog and local tier every ``--sample-seconds``
and compares the first minute with the last (first / last fifth under 2 minutes).
Results: a table on stdout and ``bench/results/soak.json`` with the whole curve.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

# Run as ``python bench/soak/soak.py``: bench/ on sys.path for ``common`` (spawned
# workers re-import this file, so they get it too).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from common import DEFAULT_WORK_DIR, Daemon, print_table, run_directory, write_results

from ckptd.daemon.local.staging import recorded_dir, segment_prefix

WAIT_EVERY = 4
KEEP = 2 * WAIT_EVERY  # retention per tier and job: never evicts a save a worker waits on
WAIT_TIMEOUT = 300.0  # a stuck save is a finding, not a hang
BLOCK_Q = {"p50": 50, "p99": 99, "max": 100}
MIB = 2**20
# flat = last <= first * 1.10 + slack. VmRSS counts the staging segments the daemon has
# touched (RssShmem), so RssAnon, the daemon's own heap, is judged on its own too.
SLACK = {"rss_bytes": 8 * MIB, "rss_anon_bytes": 8 * MIB, "fds": 4, "threads": 2}
# fmt: off
STATUS_FIELDS = (  # copied from GetStatus into each sample
    "staging_allocated_bytes", "staging_in_use_bytes", "leases_held", "saves_in_flight",
    "drain_queue", "drain_error", "checkpoints", "local_used_bytes", "evicted_local",
    "evicted_remote", "job_errors", "memory_tier_bytes", "memory_tier_files",
    "memory_tier_evicted",
)
# fmt: on


def make_state(mib: float, tensors: int, seed: int) -> dict[str, np.ndarray]:
    """``tensors`` float32 arrays totalling about ``mib`` MiB (whole 4 KiB pages each)."""
    per = max(1024, int(mib * MIB) // tensors // 4096 * 1024)
    rng = np.random.default_rng(seed)
    return {f"t{i:03d}": rng.random(per, dtype=np.float32) for i in range(tensors)}


def worker(idx: int, socket: str, cfg: dict[str, Any], out: str, barrier: Any) -> None:
    """One trainer, job ``soak-<idx>``: saves until the deadline, writes its counts to ``out``."""
    from ckptd.client import Client, Continuous

    res: dict[str, Any] = {
        "job": f"soak-{idx}",
        "pid": os.getpid(),
        "saves": 0,
        "failed": 0,
        "skipped": 0,
    }
    res["local_ok"] = 0
    res.update(errors=[], error_types={}, last_step=None, fatal=None)
    pending: list[Any] = []
    blocked: list[float] = []  # seconds inside each save(): what the trainer feels

    def fail(what: str, exc: BaseException) -> None:
        res["failed"] += 1
        kind = type(exc).__name__
        res["error_types"][kind] = res["error_types"].get(kind, 0) + 1
        if len(res["errors"]) < 20:
            res["errors"].append(f"{what}: {kind}: {exc}")

    def wait_pending() -> None:
        for h in pending:  # oldest first: a save nobody waited on counts too
            try:
                h.wait("local", timeout=WAIT_TIMEOUT)
                res["local_ok"] += 1
            except Exception as exc:
                fail(f"wait local step {h.step}", exc)
        pending.clear()

    try:
        # Continuous(): the soak is a stress test, saving as often as the daemon allows.
        client = Client(
            res["job"], socket, rank=0, node_ranks=[0], world_size=1, policy=Continuous()
        )
        state = make_state(cfg["mib"], cfg["tensors"], seed=idx)
        client.save(0, state).wait("local", timeout=WAIT_TIMEOUT)  # warm-up: leases exist
        barrier.wait(timeout=600)  # all warmed up: the measured run starts now
        deadline, step = time.monotonic() + cfg["minutes"] * 60, 1
        while time.monotonic() < deadline:
            for a in state.values():  # every 4 KiB page changes, at a fraction of a rewrite
                a[::1024] = np.float32(step)
            if cfg["step_seconds"]:
                time.sleep(cfg["step_seconds"])  # stands for the training step's compute
            if cfg["gated"] and not client.should_save(step):
                res["skipped"] += 1  # the README's loop: no room or the last save not LOCAL
                if step % WAIT_EVERY == 0:
                    wait_pending()  # else the pending list outlives local retention
                step += 1
                continue
            t = time.monotonic()
            try:
                pending.append(client.save(step, state))
                blocked.append(time.monotonic() - t)
                res["saves"] += 1
                res["last_step"] = step
            except Exception as exc:
                fail(f"save step {step}", exc)
            if step % WAIT_EVERY == 0:
                wait_pending()
            step += 1
        wait_pending()  # every acknowledged save of the last steps must become LOCAL
        client.close()
        if blocked:
            res["block_s"] = {q: float(np.percentile(blocked, p)) for q, p in BLOCK_Q.items()}
            res["blocked_over_1s"] = sum(b > 1.0 for b in blocked)
    except BaseException as exc:
        res["fatal"] = "".join(traceback.format_exception(exc))[-4000:]
        barrier.abort()  # the parent and the others need not wait out the timeout
    Path(out).write_text(json.dumps(res))


def proc_status(pid: int) -> dict[str, int]:
    """Integer fields of ``/proc/<pid>/status``; ``kB`` values in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[-1] == "kB" else 1)
    return out


def sample(daemon: Daemon, pid: int, prefix: str, t: float) -> dict[str, Any]:
    """One point of the curve: the process from /proc, the rest from ``GetStatus``."""
    st, ps = daemon.status(), proc_status(pid)
    seg_dir = recorded_dir(daemon.root)
    segs = list(seg_dir.glob(prefix + "*")) if seg_dir is not None else []
    return {
        "t": round(t, 3),
        "rss_bytes": ps.get("VmRSS"),
        "rss_anon_bytes": ps.get("RssAnon"),
        "rss_shmem_bytes": ps.get("RssShmem"),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": ps.get("Threads"),
        "shm_segments": len(segs),
        **{k: getattr(st, k) for k in STATUS_FIELDS},
        "task_restarts": sum(task.restarts for task in st.tasks),
    }


def drift(curve: list[dict[str, Any]], window: float, args: argparse.Namespace) -> dict[str, Any]:
    """First vs last ``window`` seconds: medians per metric, and whether each stayed flat.

    Staging in use is a point sample of saves in flight (0 to 4 leases per client at any
    moment): one lease per client of slack. The catalog is shown without a verdict: under
    load it can saw-tooth, so ``run()`` judges its peak instead.
    """
    slacks = {**SLACK, "staging_in_use_bytes": args.clients * args.mib * MIB}
    first = [s for s in curve if s["t"] <= window] or curve[:1]
    last = [s for s in curve if s["t"] >= curve[-1]["t"] - window] or curve[-1:]
    out = {}
    for key in (*slacks, "staging_allocated_bytes", "shm_segments", "checkpoints"):
        a, b = (statistics.median(s[key] for s in part) for part in (first, last))
        slack = slacks.get(key)
        flat = None if slack is None else b <= a * 1.10 + slack
        out[key] = {"first": a, "last": b, "slack": slack, "flat": flat}
    return out


def final_check(socket: str, results: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """Each job's last acknowledged step must have a LOCAL copy (DRAINING or DURABLE is
    fine); also what the daemon still lists per job, by state/tiers and keep reasons."""
    from ckptd.client import Client

    problems, listed = [], {}
    for r in results:
        client = Client(r["job"], socket)
        infos = client.list()
        client.close()
        listed[r["job"]] = {
            "by_state_tiers": Counter(f"{c.state} {'+'.join(c.tiers)}" for c in infos),
            "local_reasons": Counter(",".join(c.local_reasons) for c in infos),
        }
        info = {c.step: c for c in infos}.get(r["last_step"])
        if r["last_step"] is not None and (not info or "LOCAL" not in info.tiers):
            problems.append(f"{r['job']} step {r['last_step']}: {info}")
    return problems, listed


def run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """Start the daemon and the workers, sample until they finish; returns the document."""
    root, keep = run_dir / "root", f"KeepLatest({KEEP})"
    # A free-space floor --disk-cap-gib below today's free space: a local tier that runs
    # away makes admission evict or refuse (slow or failed saves, both reported) before
    # it fills a disk other people use. The daemon's default floor is 1 GiB free.
    floor = max(2**30, shutil.disk_usage(run_dir).free - int(args.disk_cap_gib * 2**30))
    extra = ["--remote", f"file://{run_dir / 'bucket'}", "--local-floor", str(floor)]
    extra += ["--retention-local", keep, "--retention-remote", keep]
    if args.memory_tier_steps is not None:
        extra += ["--memory-tier-steps", str(args.memory_tier_steps)]
    if args.staging_budget_mib:
        extra += ["--staging-budget-bytes", f"{args.staging_budget_mib}MiB"]
    daemon = Daemon(root, run_dir / "ckptd.sock", extra_args=extra).start()
    notes: list[str] = []
    try:
        pid, prefix, sock = daemon.status().pid, segment_prefix(root.resolve()), str(daemon.socket)
        ctx = mp.get_context("spawn")  # fresh interpreters: no forked gRPC state
        barrier = ctx.Barrier(args.clients + 1)
        cfg = {
            "mib": args.mib,
            "tensors": args.tensors,
            "minutes": args.minutes,
            "gated": not args.ungated,
            "step_seconds": args.step_seconds,
        }
        outs = [run_dir / f"worker-{i}.json" for i in range(args.clients)]
        procs = [
            ctx.Process(target=worker, args=(i, sock, cfg, str(out), barrier), daemon=True)
            for i, out in enumerate(outs)
        ]
        for p in procs:
            p.start()
        try:
            barrier.wait(timeout=600)
        except threading.BrokenBarrierError:
            for p in procs:
                p.join(timeout=30)
            died = [json.loads(o.read_text())["fatal"] for o in outs if o.exists()]
            raise RuntimeError(f"a worker failed to warm up: {[d for d in died if d]}") from None
        t0 = time.monotonic()
        print(f"{args.clients} clients warmed up; soaking {args.minutes} min", flush=True)
        curve: list[dict[str, Any]] = []
        while any(p.is_alive() for p in procs) and time.monotonic() - t0 < args.minutes * 60:
            curve.append(sample(daemon, pid, prefix, time.monotonic() - t0))
            time.sleep(max(0.0, t0 + len(curve) * args.sample_seconds - time.monotonic()))
        load_s = time.monotonic() - t0
        for p in procs:  # past their deadline the workers only wait out their last saves
            p.join(timeout=WAIT_TIMEOUT + 60)
            if p.is_alive():
                notes.append(f"worker pid {p.pid} still running after its deadline: terminated")
                p.terminate()
        results = [json.loads(o.read_text()) for o in outs if o.exists()]
        if len(results) < len(outs):
            notes.append(f"{len(outs) - len(results)} workers wrote no result")
        for r in results:
            if r["fatal"]:
                notes.append(f"{r['job']} died: {r['fatal'].strip().splitlines()[-1]}")
        # After the load: does the backlog clear (drain queue empty, catalog within retention)?
        settle_curve, settled_s, t1 = [], None, time.monotonic()
        while time.monotonic() - t1 < args.settle_seconds and settled_s is None:
            settle_curve.append(s := sample(daemon, pid, prefix, time.monotonic() - t0))
            if not s["drain_queue"] and s["checkpoints"] <= 2 * args.clients * KEEP:
                settled_s = time.monotonic() - t1
            else:
                time.sleep(1.0)
        problems, listed = final_check(sock, results)
        log = daemon.log_text().splitlines()
        warnings = [ln for ln in log if " WARNING " in ln or " ERROR " in ln]
    finally:
        rc = daemon.stop()
    # Shared memory left behind once everyone has exited cleanly: the daemon's segments and
    # the clients' liveness files (``ckptd-client-<pid>-*``) of this run's processes.
    pids = [os.getpid(), *(r["pid"] for r in results)]
    left = [f.name for f in Path("/dev/shm").glob(prefix + "*")]
    seg_dir = recorded_dir(daemon.root)
    left += [f.name for f in seg_dir.glob("*")] if seg_dir is not None else []
    left += [f.name for pid in pids for f in Path("/dev/shm").glob(f"ckptd-client-{pid}-*")]
    if left:
        notes.append(f"{len(left)} /dev/shm entries left behind: {', '.join(sorted(left)[:8])}")
    if settled_s is None:
        notes.append(f"backlog not cleared {args.settle_seconds:.0f} s after the load")
    if rc != 0:
        notes.append(f"daemon exit status {rc}, expected 0")
    saves, window = sum(r["saves"] for r in results), 60.0 if load_s >= 120 else load_s / 5
    # Each job may list KEEP steps per tier plus the saves it has not waited for yet; more
    # is a backlog (retention or the drain not keeping up with the load).
    bound = args.clients * (2 * KEEP + WAIT_EVERY)
    peak = max(s["checkpoints"] for s in curve)
    # save() blocking: each worker's P50 / P99, their median over the workers; the max.
    blocks = [r["block_s"] for r in results if "block_s" in r]
    block = {q: statistics.median(b[q] for b in blocks) for q in ("p50", "p99")} if blocks else {}
    block["max"] = max((b["max"] for b in blocks), default=0.0)
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "daemon_args": daemon.args[1:],
        "daemon_exit_status": rc,
        "load_seconds": load_s,
        "saves": saves,
        "failed": sum(r["failed"] for r in results),
        "skipped": sum(r.get("skipped", 0) for r in results),
        "local_ok": sum(r["local_ok"] for r in results),
        "saves_per_s": saves / load_s,
        "mib_per_s": saves * args.mib / load_s,
        "final_check_problems": problems,
        "window_seconds": window,
        "drift": drift(curve, window, args),
        "settled_after_s": settled_s,
        "backlog": {
            "peak_checkpoints": peak,
            "bound": bound,
            "bounded": peak <= bound,
            "peak_local_used_bytes": max(s["local_used_bytes"] for s in curve),
        },
        "save_block_s": block,
        "saves_blocked_over_1s": sum(r.get("blocked_over_1s", 0) for r in results),
        "error_types": dict(sum((Counter(r["error_types"]) for r in results), Counter())),
        "memory_tier": {k: curve[-1][k] for k in STATUS_FIELDS if k.startswith("memory_tier")},
        "shm_left_behind": left,
        "notes": notes,
        "daemon_warning_count": len(warnings),
        "daemon_warnings": warnings[:50],
        "workers": results,
        "listed_at_end": listed,
        "curve": curve,
        "settle_curve": settle_curve,
    }


def report(doc: dict[str, Any]) -> bool:
    """Print the tables; returns whether the run passed (flat, bounded, no failure)."""
    d, end, cleared = doc["drift"], doc["settle_curve"][-1], doc["settled_after_s"]
    flat = all(v["flat"] is not False for v in d.values())
    bl, blk, yes = doc["backlog"], doc["save_block_s"], {None: "-", True: "yes", False: "NO"}
    bounded = bl["bounded"]
    problems = doc["failed"] or doc["final_check_problems"] or doc["notes"]
    # fmt: off
    summary = [
        ["saves done (acknowledged)", doc["saves"]],
        ["steps should_save() skipped", doc["skipped"]],
        ["failed saves", doc["failed"]],
        ["saves/s", doc["saves_per_s"]],
        ["MiB/s handed off", doc["mib_per_s"]],
        ["save() blocked s: P50 / P99 / max", " / ".join(f"{blk.get(q, 0):.3f}" for q in BLOCK_Q)],
        ["saves blocked over 1 s", doc["saves_blocked_over_1s"]],
        ["save errors by type", doc["error_types"] or "-"],
        ["memory tier at the end: MiB / files / let go",
         "{memory_tier_bytes} / {memory_tier_files} / {memory_tier_evicted}".format(
             **{**doc["memory_tier"],
                "memory_tier_bytes": doc["memory_tier"]["memory_tier_bytes"] // MIB})],
        ["peak checkpoints listed under load (bound)", f"{bl['peak_checkpoints']} ({bl['bound']})"],
        ["peak local tier MiB under load", bl["peak_local_used_bytes"] / MIB],
        ["last steps LOCAL at the end", yes[not doc["final_check_problems"]]],
        ["daemon exit status", doc["daemon_exit_status"]],
        ["daemon WARNING/ERROR log lines", doc["daemon_warning_count"]],
        ["backlog cleared after the load (s)", "NO" if cleared is None else cleared],
        ["then: checkpoints listed", end["checkpoints"]],
        ["then: local tier MiB", end["local_used_bytes"] / MIB],
        ["verdict: flat (RSS, fds, threads, staging)", yes[flat]],
        ["verdict: backlog within retention under load", yes[bounded]],
    ]
    # fmt: on
    c = doc["config"]
    title = f"soak: {c['clients']} clients x {c['mib']} MiB in {c['tensors']} arrays"
    print_table(["", "value"], summary, f"{title}, {doc['load_seconds']:.0f} s")
    rows = []
    for key, v in d.items():
        scale, name = (MIB, key[: -len("_bytes")] + " MiB") if key.endswith("bytes") else (1, key)
        slack = None if v["slack"] is None else v["slack"] / scale
        rows.append([name, v["first"] / scale, v["last"] / scale, slack, yes[v["flat"]]])
    head = f"daemon, medians of the first vs last {doc['window_seconds']:.0f} s"
    print_table(
        ["metric", "first", "last", "slack", "flat"], rows, head + " (last <= first*1.1+slack)"
    )
    for line in doc["notes"] + doc["final_check_problems"] + doc["daemon_warnings"][:5]:
        print(f"note: {line}")
    for r in doc["workers"]:
        for e in r["errors"][:3]:
            print(f"{r['job']}: {e}")
    return flat and bounded and not problems


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--minutes", type=float, help="measured run length (default 10; --quick 0.5)")
    p.add_argument("--clients", type=int, help="client processes, one job each (default 8; 4)")
    p.add_argument("--mib", type=float, help="state size per client in MiB (default 16; 8)")
    p.add_argument("--tensors", type=int, default=64, help="arrays per state (default 64)")
    p.add_argument("--sample-seconds", type=float, help="sampling period (default 5; 2)")
    p.add_argument("--settle-seconds", type=float, default=120.0, help="backlog wait (120)")
    p.add_argument("--disk-cap-gib", type=float, default=16.0, help="local tier cap (16)")
    p.add_argument("--quick", action="store_true", help="0.5 min, 4 clients, 8 MiB, 2 s samples")
    p.add_argument(
        "--ungated",
        action="store_true",
        help="save at every step, ignoring should_save() (an overload test, not a training loop)",
    )
    p.add_argument(
        "--step-seconds", type=float, default=0.02, help="simulated compute per step (0.02)"
    )
    p.add_argument(
        "--memory-tier-steps", type=int, help="the daemon's memory_tier_steps (default: its own)"
    )
    p.add_argument(
        "--staging-budget-mib", type=int, help="the daemon's staging budget (default: its own)"
    )
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch dir (same disk)")
    p.add_argument("--name", default="soak", help="results file bench/results/NAME.json")
    args = p.parse_args(argv)
    q = args.quick
    args.minutes = args.minutes or (0.5 if q else 10.0)
    args.clients = args.clients or (4 if q else 8)
    args.mib = args.mib or (8.0 if q else 16.0)
    # Short runs sample more often, so that each comparison window holds several samples.
    args.sample_seconds = args.sample_seconds or (2.0 if q else 5.0)
    if min(args.minutes, args.clients, args.mib, args.tensors, args.sample_seconds) <= 0:
        p.error("--minutes, --clients, --mib, --tensors and --sample-seconds must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the soak; returns 0 if the daemon stayed flat and no save failed."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally clauses run
    args.dir = args.dir.resolve()
    with run_directory(args.dir, "soak") as run_dir:
        doc = run(args, run_dir)
    ok = report(doc)
    print(f"results: {write_results(args.name, doc, work_dir=args.dir)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
