"""The peer tier benchmark: a lost node's restore from a peer against the bucket, and
what replication costs a training loop.

One run, one SeaweedFS S3 server and three daemons on 127.0.0.1 (nodes a, b, c,
each its own root, socket and TCP port, peers of each other; a's replicas go to
b). Node a saves ``--size-gib`` of float32 (``--arrays`` arrays) and waits until
it is in the bucket and on b. Each repetition then loses node a (SIGKILL, root
deleted) and restores it three ways, in alternating order:

- ``restore_peer``: a replacement daemon with the peers configured; from its launch
  until ``restore()`` returned and every byte was touched (it pre-stages from b
  while it starts; the restore then reads the local copy);
- ``restore_bucket``: a replacement daemon without peers; from its launch until the
  same point (the restore fetches from the bucket);
- ``s5cmd``: ``s5cmd cp`` of node a's rank files from the bucket into an empty
  directory, then an fsync of each (the bytes alone, no daemon, no check).

``ready`` is a replacement daemon's launch until it answers, the part of both
ckptd arms that is not the transfer. ``restore_peer_call`` / ``restore_bucket_call``:
the same, timing only the trainer's ``restore()`` (+ touch), called once the daemon
is up and, with peers, its pre-staging done (committed locally, then copied into
shared memory: status ``peer_prestaged_bytes``): a trainer starts after its node's
daemon (image, framework start-up), which is the pre-staging's point.

The loop: ``--steps`` steps of a CPU step (16 numpy 1024x1024 matmuls, ~0.25 s)
each followed by a save of the state under ``Continuous()`` (a save whenever the
last one is LOCAL), with replication to b on (``loop_peers``) and off
(``loop_alone``), no bucket (so that replication is all that differs), each twice
(A B A B); the figure is each run's mean step (wall time per step, saves included).
With replication, how far the replica trails: at each save reaching LOCAL, the age
of the newest replicated step (from the daemon's LOCAL and REPLICATED events).

``--tls``: the daemons speak mutual TLS to each other (peer_tls_*, test certificates
made with the openssl command).

Results: a table on stdout and bench/results/peer.json (``--name``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    DEFAULT_WORK_DIR,
    REPO_ROOT,
    Daemon,
    drop_caches,
    print_table,
    run_directory,
    settle,
    summarize,
    write_results,
)
from floors import touch

from ckptd.client import Client, Continuous

BIN = Path(sys.executable).parent
BUCKET = "peer"
JOB = "peer"
NODES = ("a", "b", "c")
TOKEN = "bench-token-0123456789abcdef0123"
GOALS = [
    ("restore() once the daemon is up: peer / bucket", "restore_peer_call",
     "restore_bucket_call", 0.5),
    ("from the daemon's launch: peer / bucket", "restore_peer", "restore_bucket", None),
    ("from the daemon's launch: peer / s5cmd download+fsync", "restore_peer", "s5cmd", None),
    ("loop mean step, replicating / alone", "loop_peers", "loop_alone", 1.05),
]  # fmt: skip
LOCAL = 2  # pb.STEP_EVENT_LOCAL
REPLICATED = 19  # pb.STEP_EVENT_REPLICATED


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) a live process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def replica_lag(events: list[Any]) -> dict[str, float]:
    """How far the peer's replica trailed the saves: at each save reaching LOCAL, the
    age of the newest step replicated by then (seconds since that step was LOCAL; a
    save before any replica is skipped), and how many saves were ever replicated
    (superseded ones are skipped by design)."""
    local = {e.step: e.time_unix for e in events if e.kind == LOCAL}
    replicated = sorted((e.time_unix, e.step) for e in events if e.kind == REPLICATED)
    ages = []
    for _, t in sorted(local.items()):
        done = [s for at, s in replicated if at <= t and s in local]
        if done:
            ages.append(t - local[max(done)])
    ages = ages or [float("nan")]
    return {
        "p50": statistics.median(ages),
        "max": max(ages),
        "replicated": len({s for _, s in replicated}),
        "saved": len(local),
    }


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PeerBench:
    """Three daemons, one bucket, node a's state."""

    def __init__(self, args: argparse.Namespace, run_dir: Path, s3: Any) -> None:
        self.args, self.run_dir, self.s3 = args, run_dir, s3
        (run_dir / "token").write_text(TOKEN)
        (run_dir / "token").chmod(0o600)
        self.ports = {n: free_port() for n in NODES}
        self.samples: dict[str, list[float]] = {
            k: []
            for k in (
                "restore_peer", "restore_bucket", "restore_peer_call", "restore_bucket_call",
                "s5cmd", "ready",
            )
        }  # fmt: skip
        self.wait_for_trainer = False
        self.seen: set[str] = set()
        self.loop: dict[str, list[float]] = {}
        self.cores: dict[str, dict[str, float]] = {}
        self.lag: dict[str, dict[str, float]] = {}
        self.daemons: dict[str, Daemon] = {}
        rng = np.random.default_rng(0)
        per = int(args.size_gib * 2**30) // 4 // args.arrays
        self.state = {f"w{i}": rng.standard_normal(per, np.float32) for i in range(args.arrays)}
        self.size = sum(a.nbytes for a in self.state.values())
        self.step = 0
        self.pki: Any = None
        if args.tls:
            from tests.pki import make_pki

            self.pki = make_pki(run_dir / "pki")

    def daemon(self, node: str, peers: bool = True, bucket: bool = True) -> Daemon:
        """A daemon for ``node`` (not started)."""
        args = [
            "--node-id", node, "--retention-local", "KeepLatest(1)",
            "--retention-remote", "KeepLatest(1)", "--metrics-address", "off",
        ]  # fmt: skip
        if bucket:
            args += ["--remote", f"s3://{BUCKET}/ckpt"]
        if self.args.peer_bandwidth:
            args += ["--peer-bandwidth-bytes", self.args.peer_bandwidth]
        if self.args.peer_max_lag:
            args += ["--peer-max-lag-seconds", self.args.peer_max_lag]
        if peers:
            args += [
                "--peer-address", f"127.0.0.1:{self.ports[node]}",
                "--peers", ",".join(f"127.0.0.1:{p}" for p in self.ports.values()),
                "--peer-token-file", str(self.run_dir / "token"),
            ]  # fmt: skip
            if self.pki is not None:  # --tls: mutual TLS between the daemons
                args += [
                    "--peer-tls-cert-file", str(self.pki.cert),
                    "--peer-tls-key-file", str(self.pki.key),
                    "--peer-tls-ca-file", str(self.pki.ca),
                ]  # fmt: skip
        return Daemon(
            self.run_dir / f"root-{node}",
            self.run_dir / f"{node}.sock",
            extra_args=args,
            env=self.s3.env(),
            log_path=self.run_dir / f"{node}.log",
            start_timeout=120.0,
        )

    def start(self) -> None:
        for node in NODES:
            self.daemons[node] = self.daemon(node).start()

    def save(self, node: str = "a") -> int:
        """Save the state on ``node``; wait until it is in the bucket and on a peer."""
        self.step += 1
        client = Client(JOB, socket=self.daemons[node].socket, timeout=600.0)
        try:
            client.save(self.step, self.state).wait("durable", 600)
            deadline = time.monotonic() + 600
            while "PEER" not in next(c for c in client.list() if c.step == self.step).tiers:
                if time.monotonic() > deadline:
                    raise RuntimeError("the step never reached a peer")
                time.sleep(0.05)
        finally:
            client.close()
        return self.step

    def lose_a(self) -> None:
        d = self.daemons.pop("a")
        d.kill()
        d.close()
        shutil.rmtree(d.root)

    def restore(self, peers: bool) -> None:
        """Lose node a and bring it back through a replacement daemon."""
        self.lose_a()
        drop_caches(self.run_dir)
        settle()
        t0 = time.perf_counter()
        d = self.daemon("a", peers).start()
        ready = time.perf_counter() - t0
        client = Client(JOB, socket=d.socket, timeout=600.0)
        try:
            if self.wait_for_trainer:
                # The trainer starts after the daemon (a pod's image, jax's start-up):
                # with peers, the pre-staging has finished by then.
                deadline = time.monotonic() + 600
                # Pre-staged: committed locally, then copied into shared memory.
                while peers and d.status().peer_prestaged_bytes < self.size:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the pre-staging never finished")
                    time.sleep(0.01)
                t0 = time.perf_counter()
            tree, _ = client.restore()
            touch(tree)
            took = time.perf_counter() - t0
            tiers = client.list()[0].tiers
            assert np.array_equal(tree["w0"], self.state["w0"]), "restored bytes differ"
            del tree
        finally:
            client.close()
        call = "_call" if self.wait_for_trainer else ""
        self.samples[("restore_peer" if peers else "restore_bucket") + call].append(took)
        self.samples["ready"].append(ready)
        via = d.events(JOB)[-1]
        print(f"  {'peer' if peers else 'bucket'}: {took:.2f} s (ready {ready:.2f} s; {tiers}; "
              f"last event {via.kind} {dict(via.attributes)})", flush=True)  # fmt: skip
        for line in (self.run_dir / "a.log").read_text().splitlines():
            if "taken from peers" in line and line not in self.seen:  # the daemon's own time
                self.seen.add(line)
                print("   ", line.split("ckptd.peer", 1)[-1].strip(), flush=True)
        if not peers:  # back with its peers for the next repetition
            d.stop()
            d = self.daemon("a").start()
        self.daemons["a"] = d

    def s5cmd(self) -> None:
        """Download node a's rank files of the newest step with s5cmd, fsync them."""
        dest = self.run_dir / "s5cmd"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        keys = subprocess.run(
            [str(BIN / "s5cmd"), "--endpoint-url", self.s3.endpoint_url, "ls",
             f"s3://{BUCKET}/ckpt/{JOB}/_data/*"],
            capture_output=True, text=True, env={**os.environ, **self.s3.env()}, check=True,
        ).stdout.split()  # fmt: skip
        names = [k for k in keys if k.endswith(".safetensors") and f"/{self.step}/" in k]
        if not names:
            raise RuntimeError(f"no rank files of step {self.step} in the bucket: {keys[:8]}")
        drop_caches(self.s3.data_dir)
        settle()
        t0 = time.perf_counter()
        subprocess.run(
            [str(BIN / "s5cmd"), "--endpoint-url", self.s3.endpoint_url, "cp",
             f"s3://{BUCKET}/ckpt/{JOB}/_data/*/a/{self.step}/*", f"{dest}/"],
            capture_output=True, env={**os.environ, **self.s3.env()}, check=True,
        )  # fmt: skip
        for p in dest.iterdir():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self.samples["s5cmd"].append(time.perf_counter() - t0)
        shutil.rmtree(dest)

    def training_loop(self, name: str, peers: bool) -> None:
        """``--steps`` CPU steps, each followed by ``Continuous()``'s save decision."""
        d = self.daemons.pop("a")
        d.stop()
        # No drain: what replication adds is measured against saves alone.
        d = self.daemons["a"] = self.daemon("a", peers, bucket=False).start()
        client = Client(JOB, socket=d.socket, policy=Continuous(), timeout=600.0)
        x = np.random.default_rng(1).standard_normal((1024, 1024), np.float32)
        times = []
        pids = {n: self.daemons[n].proc.pid for n in ("a", "b")}  # type: ignore[union-attr]
        cpu0 = {n: proc_cpu(pid) for n, pid in pids.items()}
        wall0 = time.perf_counter()
        try:
            for _ in range(self.args.steps):
                t0 = time.perf_counter()
                for _ in range(self.args.matmuls):
                    x = np.tanh(x @ x.T / 1024)
                self.step += 1
                if client.should_save(self.step):
                    client.save(self.step, self.state)
                times.append(time.perf_counter() - t0)
            client.wait_until_finished()
        finally:
            client.close()
        wall = time.perf_counter() - wall0
        # Cores each daemon kept busy during the loop (the step's matmuls use both).
        self.cores[name] = {n: (proc_cpu(pid) - cpu0[n]) / wall for n, pid in pids.items()}
        cores = ", ".join(f"{n} {c:.2f}" for n, c in self.cores[name].items())
        lag = ""
        if peers:
            self.lag[name] = replica_lag(d.events(JOB))
            lag = (
                "; replica age at each save P50 {p50:.2f} s, max {max:.2f} s, "
                "{replicated} of {saved} saves replicated".format(**self.lag[name])
            )
        print(f"  {name}: mean step {statistics.mean(times[5:]):.3f} s; daemon cores {cores}{lag}")
        self.loop[name] = times

    def stop(self) -> None:
        for d in self.daemons.values():
            d.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="node a's state (GiB)")
    ap.add_argument("--arrays", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="steps per training-loop arm")
    ap.add_argument("--matmuls", type=int, default=16, help="1024^2 matmuls per step")
    ap.add_argument("--peer-bandwidth", default="", help="peer_bandwidth_bytes (default: ckptd's)")
    ap.add_argument("--peer-max-lag", default="", help="peer_max_lag_seconds (default: ckptd's)")
    ap.add_argument("--loop-only", action="store_true", help="only the training-loop arms")
    ap.add_argument("--restore-only", action="store_true", help="only the restore arms")
    ap.add_argument("--tls", action="store_true", help="mutual TLS between the daemons")
    ap.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR)
    ap.add_argument("--name", default="peer")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    from tests.servers import SeaweedS3

    t_start = time.perf_counter()
    with run_directory(args.dir.resolve(), "peer") as run_dir:
        s3 = SeaweedS3(run_dir / "seaweed", volume_size_limit_mb=8192).start()
        bench = PeerBench(args, run_dir, s3)
        try:
            s3.make_bucket(BUCKET)
            bench.start()
            bench.save()
            for rep in range(0 if args.loop_only else args.reps):
                order = (True, False) if rep % 2 == 0 else (False, True)
                for peers in order:
                    bench.restore(peers)
                bench.wait_for_trainer = True
                for peers in order:
                    bench.restore(peers)
                bench.wait_for_trainer = False
                bench.s5cmd()
                print(f"rep {rep + 1}/{args.reps}: "
                      + ", ".join(f"{k} {v[-1]:.2f}" for k, v in bench.samples.items()),
                      flush=True)  # fmt: skip
            for name, peers in (("loop_alone", False), ("loop_peers", True)) * (
                0 if args.restore_only else 2
            ):
                bench.training_loop(name + ("" if name not in bench.loop else "_2"), peers)
        finally:
            bench.stop()
            s3.close()
    loops: dict[str, list[float]] = {k.removesuffix("_2"): [] for k in bench.loop}
    for k, v in bench.loop.items():
        loops[k.removesuffix("_2")] += v[5:]  # the first steps: the segment's first faults
    arms = {k: summarize(v) for k, v in bench.samples.items()}
    # A loop's cost is its wall time: the mean step (saves included), per run of the arm.
    for k in loops:
        runs = [statistics.mean(v[5:]) for name, v in bench.loop.items() if name.startswith(k)]
        arms[k] = summarize(runs)
    rows = [[k, f"{a['median']:.3f}", f"{a['min']:.3f}", f"{a['max']:.3f}", a["n"]]
            for k, a in arms.items() if a["n"]]  # fmt: skip
    print_table(["arm", "median s", "min", "max", "n"], rows, title="peer tier")
    goals = []
    for label, num, den, goal in GOALS:
        if num not in arms or den not in arms or not arms[num]["n"] or not arms[den]["n"]:
            continue
        ratio = arms[num]["median"] / arms[den]["median"]
        met = None if goal is None else ratio <= goal
        goals.append({"ratio": label, "value": ratio, "goal": goal, "met": met})
    print_table(
        ["ratio (of medians)", "value", "goal", "status"],
        [
            [
                g["ratio"],
                f"{g['value']:.3f}",
                g["goal"] or "-",
                {True: "met", False: "NOT met", None: "-"}[g["met"]],
            ]
            for g in goals
        ],
    )
    doc = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "arms": arms,
        "goals": goals,
        "loop_step_mean": {k: statistics.mean(v) for k, v in loops.items()},
        "loop_daemon_cores": bench.cores,
        "loop_replica_lag": bench.lag,
        "seconds": time.perf_counter() - t_start,
    }
    print(f"results: {write_results(args.name, doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
