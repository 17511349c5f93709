"""The drain benchmark: ckptd's upload to, and restore from, a local S3 server against peers.

One run, one SeaweedFS S3 server on 127.0.0.1 (``tests.servers.SeaweedS3``, its data
under ``--dir``), one ckptd daemon draining to it. Each step is saved by ``--ranks``
clients in threads (one safetensors file per rank, ``--size-gib`` in all). The peers
upload the same rank files (copied out of the daemon's local tier) to the same server:
``s5cmd cp``, ``aws s3 cp --recursive`` and s3fs ``put``; the restore side compares
ckptd's restore from the bucket (empty local tier) with ``s5cmd cp`` downloading.
Every repetition runs every arm; the order rotates between repetitions.

Results: a table on stdout and ``bench/results/drain.json``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
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
    source_digest,
    summarize,
    write_results,
)
from floors import touch

from ckptd.client import Client, SaveHandle
from ckptd.proto import ckptd_pb2 as pb

JOB = "bench"
BUCKET = "ckptd-bench"
PREFIX = "ckptd"
NODE = "bench-node"
GB = 1e9
BIN = Path(sys.executable).parent
PEERS = ("s5cmd", "aws", "s3fs")
ARM_ROWS: list[tuple[str, str]] = [
    ("drain", "ckptd LOCAL -> DURABLE (headline)"),
    ("handoff_durable", "ckptd save() x ranks start -> DURABLE"),
    ("handoff_local", "ckptd save() x ranks start -> LOCAL"),
    ("drain_daemon", "info: daemon events, DURABLE - LOCAL"),
    ("up_s5cmd", "peer: s5cmd cp 'DIR/*' s3://..."),
    ("up_aws", "peer: aws s3 cp --recursive DIR s3://..."),
    ("up_s3fs", "peer: s3fs put (in-process)"),
    ("restore_bucket", "ckptd restore() x ranks, from bucket (headline)"),
    ("restore_bucket_touch", "ckptd restore() x ranks + touch every byte"),
    ("fetch_daemon", "info: restore start -> daemon event FETCHED"),
    ("down_s5cmd", "peer: s5cmd cp 's3://.../*' DIR/"),
    ("down_s5cmd_fsync", "peer: s5cmd download + fsync each file"),
]
# (ratio, numerator arm, denominator arm, goal or None); "up_fastest" is the fastest peer upload.
# The goals are issue 13's: drain <= 0.8x the fastest peer, restore <= 1.0x s5cmd + fsync
# (ckptd's restore has its files fsynced, like every local commit).
RATIOS: list[tuple[str, str, str, float | None]] = [
    ("ckptd LOCAL->DURABLE / fastest peer upload", "drain", "up_fastest", 0.8),
    ("ckptd handoff->DURABLE / fastest peer upload", "handoff_durable", "up_fastest", None),
    ("ckptd restore from bucket / s5cmd download", "restore_bucket", "down_s5cmd", None),
    ("ckptd restore+touch / s5cmd download", "restore_bucket_touch", "down_s5cmd", None),
    ("ckptd restore / s5cmd download+fsync", "restore_bucket", "down_s5cmd_fsync", 1.0),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="checkpoint size (default 1.0)")
    p.add_argument("--ranks", type=int, default=4, help="ranks = files per step (default 4)")
    p.add_argument("--arrays", type=int, default=2, help="float32 arrays per rank (default 2)")
    p.add_argument("--reps", type=int, default=3, help="measured repetitions (default 3)")
    p.add_argument("--part-size", default="16MiB", help="ckptd --part-size-bytes (16MiB)")
    p.add_argument("--drain-concurrency", type=int, default=8, help="ckptd --drain-concurrency")
    p.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_WORK_DIR,
        help=f"scratch dir on the disk under test (default {DEFAULT_WORK_DIR})",
    )
    p.add_argument("--seed", type=int, default=0, help="numpy default_rng seed")
    p.add_argument("--name", default="drain", help="results file name (bench/results/NAME.json)")
    p.add_argument("--keep-log", type=Path, help="copy the daemon's log here at the end")
    p.add_argument(
        "--only",
        choices=("all", "restore"),
        default="all",
        help="'restore': only the restore arms (ckptd restore of step 0 and s5cmd download "
        "of one untimed s5cmd upload, each rep); quicker when working on restore",
    )
    args = p.parse_args(argv)
    if args.size_gib <= 0 or args.ranks < 1 or args.arrays < 1 or args.reps < 1:
        p.error("--size-gib, --ranks, --arrays and --reps must be positive")
    return args


def make_states(size_bytes: int, ranks: int, arrays: int, seed: int) -> list[dict[str, Any]]:
    """Per rank, a dict of ``arrays`` random float32 arrays; ~``size_bytes`` in all."""
    per_array = max(1024, (size_bytes // ranks // arrays // 4) // 1024 * 1024)  # elements
    rng = np.random.default_rng(seed)
    return [
        {
            f"layer{i:02d}": rng.random(per_array, dtype=np.float32).reshape(-1, 1024)
            for i in range(arrays)
        }
        for _ in range(ranks)
    ]


def aws_command() -> list[str]:
    """The AWS CLI of this interpreter's environment."""
    script = BIN / "aws"
    return [str(script)] if script.exists() else [sys.executable, "-m", "awscli"]


def run_tool(cmd: list[str], env: dict[str, str]) -> None:
    """Run a peer's command line; raise with its output if it fails."""
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        out = proc.stdout.decode(errors="replace")[-3000:]
        raise RuntimeError(f"{cmd[0]} exited with status {proc.returncode}:\n{out}")


def tool_version(cmd: list[str], env: dict[str, str]) -> str:
    """First line of a tool's version output (also loads it into the page cache)."""
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    text = (proc.stdout or proc.stderr).decode(errors="replace").strip()
    return text.splitlines()[0] if text else "unknown"


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) a live process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rusage_cpu(who: int) -> float:
    """CPU seconds of this process (``RUSAGE_SELF``) or its reaped children."""
    ru = resource.getrusage(who)
    return ru.ru_utime + ru.ru_stime


def rss_anon(pid: int) -> int:
    """A process's anonymous resident memory in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class CpuMeter:
    """CPU seconds used between :meth:`start` and :meth:`stop` by the uploader or downloader
    (``client``: the daemon, this process and/or reaped child processes) and by the server."""

    def __init__(self, server_pid: int, daemon_pid: int | None = None) -> None:
        self.server_pid, self.daemon_pid = server_pid, daemon_pid
        self.client = self.server = 0.0

    def _read(self) -> tuple[float, float]:
        client = rusage_cpu(resource.RUSAGE_SELF) + rusage_cpu(resource.RUSAGE_CHILDREN)
        if self.daemon_pid is not None:
            client += proc_cpu(self.daemon_pid)
        return client, proc_cpu(self.server_pid)

    def start(self) -> CpuMeter:
        self._c0, self._s0 = self._read()
        return self

    def stop(self) -> CpuMeter:
        c1, s1 = self._read()
        self.client, self.server = c1 - self._c0, s1 - self._s0
        return self


class AnonPeak:
    """Samples a process's ``RssAnon`` every 50 ms on a thread; ``peak`` is the highest seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.base = pid, 0, rss_anon(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_anon(self.pid))

    def stop(self) -> int:
        """Stop sampling; returns the peak growth over the level at start, in bytes."""
        self._stop.set()
        self._thread.join()
        return max(0, max(self.peak, rss_anon(self.pid)) - self.base)


class DrainBench:
    """State of one run: data, server, daemon, clients, and the samples per arm."""

    def __init__(self, args: argparse.Namespace, run_dir: Path, s3: Any) -> None:
        self.args = args
        self.run_dir = run_dir
        self.s3 = s3
        self.root = run_dir / "root"
        self.peer_src = run_dir / "peer-src"
        self.log_path = run_dir / "ckptd.log"
        self.env = {**os.environ, **s3.env()}
        self.samples: dict[str, list[float]] = {name: [] for name, _ in ARM_ROWS}
        # CPU seconds per arm: [client (uploader/downloader), server (SeaweedFS)] per rep.
        self.cpu: dict[str, list[tuple[float, float]]] = {}
        self.drain_anon_growth: list[int] = []
        self.notes: list[str] = []
        self.restore_paths: list[str] = []
        self.rewarm: list[dict[str, float]] = []
        self.first: dict[str, float] = {}
        self.daemon: Daemon | None = None
        self.clients: list[Client] = []
        self._step = 0
        t0 = time.perf_counter()
        size = int(args.size_gib * 2**30)
        self.states = make_states(size, args.ranks, args.arrays, args.seed)
        self.setup_seconds = time.perf_counter() - t0
        self.files: dict[str, int] = {}  # rank file name -> size
        self.file_crcs: dict[str, int] = {}  # rank file name -> crc32c (step 0's manifest)

    # -- daemon and clients ----------------------------------------------------------
    def start_daemon(self) -> None:
        """Start ``ckptd serve`` draining to the bucket, and one client per rank."""
        extra = [
            "--remote",
            f"s3://{BUCKET}/{PREFIX}",
            "--node-id",
            NODE,
            "--part-size-bytes",
            self.args.part_size,
            "--drain-concurrency",
            str(self.args.drain_concurrency),
        ]
        self.daemon = Daemon(
            self.root,
            self.run_dir / "ckptd.sock",
            extra_args=extra,
            env=self.s3.env(),
            log_path=self.log_path,
            start_timeout=60.0,
        ).start()
        ranks = list(range(self.args.ranks))
        self.clients = [
            Client(JOB, socket=self.daemon.socket, rank=r, node_ranks=ranks, timeout=600.0)
            for r in ranks
        ]

    def stop_daemon(self) -> None:
        """Close the clients and stop the daemon."""
        for c in self.clients:
            c.close()
        self.clients = []
        if self.daemon is not None:
            rc = self.daemon.stop()
            self.daemon = None
            if rc not in (0, None):
                self.notes.append(f"ckptd serve exited with status {rc}")

    def next_step(self) -> int:
        """A step number not used before in this run."""
        self._step += 1
        return self._step

    def log_text(self) -> str:
        """Everything the daemon logged in this run (all its starts)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    # -- ckptd arms --------------------------------------------------------------------
    def save_step(self, step: int) -> dict[str, float]:
        """Every rank saves its part of ``step`` in its own thread; wait for LOCAL, DURABLE."""
        errors: list[BaseException] = []

        def save(r: int) -> None:
            try:
                self.clients[r].save(step, self.states[r])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=save, args=(r,)) for r in range(self.args.ranks)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t_saved = time.perf_counter()
        if errors:
            raise errors[0]
        # The step's state, whichever rank asks.
        handle = SaveHandle(self.clients[0], step)
        handle.wait("local", timeout=600)
        t_local = time.perf_counter()
        assert self.daemon is not None and self.daemon.proc is not None
        meter = CpuMeter(self.s3.proc.pid, self.daemon.proc.pid).start()
        anon = AnonPeak(self.daemon.proc.pid)
        handle.wait("durable", timeout=600)
        t_durable = time.perf_counter()
        meter.stop()
        self.last_drain_cpu = (meter.client, meter.server)
        self.last_drain_anon = anon.stop()
        local_log = self.daemon.event_time(JOB, step, pb.STEP_EVENT_LOCAL)
        durable_log = self.daemon.event_time(JOB, step, pb.STEP_EVENT_DURABLE)
        out = {
            "save": t_saved - t0,
            "handoff_local": t_local - t0,
            "drain": t_durable - t_local,
            "handoff_durable": t_durable - t0,
        }
        if local_log is not None and durable_log is not None:
            out["drain_daemon"] = durable_log - local_log
        return out

    def ckptd_upload(self) -> None:
        """Time one step's save -> LOCAL -> DURABLE (its files drained to the bucket)."""
        step = self.next_step()
        settle()
        times = self.save_step(step)
        for arm in ("drain", "handoff_durable", "handoff_local", "drain_daemon"):
            if arm in times:
                self.samples[arm].append(times[arm])
        self.last_ckptd_step = step
        self.cpu.setdefault("drain", []).append(self.last_drain_cpu)
        self.drain_anon_growth.append(self.last_drain_anon)
        self._check_objects(f"{PREFIX}/{JOB}/{step}/{NODE}/", with_manifest=True)
        if self.manifest_crcs(step) != self.file_crcs:  # the peers upload step 0's files
            raise RuntimeError(f"step {step}'s rank files differ from step 0's")

    def warm_up(self) -> None:
        """Step 0's save allocates the leases; copy its rank files out for the peers."""
        settle()
        self.first = self.save_step(0)
        step_dir = self.root / JOB / "0"
        self.peer_src.mkdir()
        for src in sorted(step_dir.glob("rank-*.safetensors")):
            shutil.copyfile(src, self.peer_src / src.name)
            self.files[src.name] = src.stat().st_size
        if len(self.files) != self.args.ranks:
            raise RuntimeError(f"expected {self.args.ranks} rank files in {step_dir}")
        self.file_crcs = self.manifest_crcs(0)
        drop_caches(self.peer_src)
        drop_caches(step_dir)

    def manifest_crcs(self, step: int) -> dict[str, int]:
        """``{rank file: crc32c}`` from a local step's manifest."""
        manifest = json.loads((self.root / JOB / str(step) / "manifest.json").read_text())
        return {r["file"]: r["crc32c"] for r in manifest["ranks"]}

    def ckptd_restore(self, step: int) -> None:
        """Stop the daemon, empty its local tier, restart it, restore ``step`` from the bucket."""
        self.stop_daemon()
        shutil.rmtree(self.root)
        self.start_daemon()
        drop_caches(self.s3.data_dir)
        settle()
        ranks = self.args.ranks
        got: list[Any] = [None] * ranks
        returned = [0.0] * ranks
        touched = [0.0] * ranks
        errors: list[BaseException] = []

        def restore(r: int) -> None:
            try:
                tree, _meta = self.clients[r].restore(step=step)
                returned[r] = time.perf_counter()
                touch(tree)
                touched[r] = time.perf_counter()
                got[r] = tree
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=restore, args=(r,)) for r in range(ranks)]
        assert self.daemon is not None and self.daemon.proc is not None
        meter = CpuMeter(self.s3.proc.pid, self.daemon.proc.pid).start()
        wall0 = time.time()
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        meter.stop()
        if errors:
            raise errors[0]
        self.cpu.setdefault("restore_bucket_touch", []).append((meter.client, meter.server))
        self.samples["restore_bucket"].append(max(returned) - t0)
        self.samples["restore_bucket_touch"].append(max(touched) - t0)
        fetched = self.daemon.event_time(JOB, step, pb.STEP_EVENT_FETCHED)
        if fetched is not None:
            self.samples["fetch_daemon"].append(fetched - wall0)
        maps = Path("/proc/self/maps").read_text()
        via = [k for k, hit in (("file", str(self.root)), ("shm", "/dev/shm/")) if hit in maps]
        self.restore_paths.append("+".join(via) or "?")
        for r in range(ranks):
            for key, want in self.states[r].items():
                if not np.array_equal(got[r][key], want):
                    raise RuntimeError(f"rank {r} {key}: restored bytes differ from the saved")
        got.clear()  # unmaps the restored files / returns the segments
        gc.collect()
        # The restarted daemon has no leases yet: an untimed save allocates them again, so
        # the next timed save finds them as the first rep did.
        settle()
        self.rewarm.append(self.save_step(self.next_step()))

    # -- peer arms ---------------------------------------------------------------------
    def peer_upload(self, tool: str, rep: int) -> None:
        """Upload the rank files with ``tool`` to ``peer-<tool>/<rep>/``, starting cold."""
        prefix = f"peer-{tool}/{rep}/"
        url = self.s3.endpoint_url
        src = self.peer_src
        fn: Callable[[], None]
        if tool == "s5cmd":
            cmd = [str(BIN / "s5cmd"), "--endpoint-url", url, "cp"]
            cmd += [f"{src}/*", f"s3://{BUCKET}/{prefix}"]
            fn = lambda: run_tool(cmd, self.env)  # noqa: E731
        elif tool == "aws":
            cmd = [*aws_command(), "s3", "cp", "--recursive", "--only-show-errors"]
            cmd += ["--endpoint-url", url, str(src), f"s3://{BUCKET}/{prefix}"]
            fn = lambda: run_tool(cmd, self.env)  # noqa: E731
        else:
            fn = lambda: self._s3fs_put(prefix)  # noqa: E731
        drop_caches(src)
        settle()
        meter = CpuMeter(self.s3.proc.pid).start()
        t0 = time.perf_counter()
        fn()
        self.samples[f"up_{tool}"].append(time.perf_counter() - t0)
        meter.stop()
        self.cpu.setdefault(f"up_{tool}", []).append((meter.client, meter.server))
        self._check_objects(prefix)

    def _s3fs_put(self, prefix: str) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.s3.s3fs_kwargs())
        names = sorted(self.files)
        fs.put([str(self.peer_src / n) for n in names], [f"{BUCKET}/{prefix}{n}" for n in names])

    def peer_download(self, rep: int, source_rep: int | None = None) -> None:
        """``s5cmd cp`` the files s5cmd uploaded this rep (or ``source_rep``) into an empty
        dir, then fsync them."""
        dest = self.run_dir / f"down-{rep}"
        dest.mkdir()
        src_rep = rep if source_rep is None else source_rep
        cmd = [str(BIN / "s5cmd"), "--endpoint-url", self.s3.endpoint_url, "cp"]
        cmd += [f"s3://{BUCKET}/peer-s5cmd/{src_rep}/*", f"{dest}/"]
        drop_caches(self.s3.data_dir)
        settle()
        meter = CpuMeter(self.s3.proc.pid).start()
        t0 = time.perf_counter()
        run_tool(cmd, self.env)
        t1 = time.perf_counter()
        meter.stop()
        self.cpu.setdefault("down_s5cmd", []).append((meter.client, meter.server))
        for name in self.files:
            fd = os.open(dest / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        t2 = time.perf_counter()
        self.samples["down_s5cmd"].append(t1 - t0)
        self.samples["down_s5cmd_fsync"].append(t2 - t0)
        sizes = {p.name: p.stat().st_size for p in dest.iterdir()}
        if sizes != self.files:
            raise RuntimeError(f"s5cmd downloaded {sizes}, expected {self.files}")
        shutil.rmtree(dest)

    def _check_objects(self, prefix: str, with_manifest: bool = False) -> None:
        """The bucket holds every rank file under ``prefix`` with its size."""
        resp = self.s3.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
        found = {o["Key"][len(prefix) :]: o["Size"] for o in resp.get("Contents", [])}
        if with_manifest and found.pop("manifest.json", None) is None:
            raise RuntimeError(f"no manifest.json under s3://{BUCKET}/{prefix}")
        if found != self.files:
            raise RuntimeError(f"s3://{BUCKET}/{prefix} holds {found}, expected {self.files}")

    # -- one repetition ----------------------------------------------------------------
    def rep(self, rep: int) -> None:
        """Every upload arm (order rotated), then restore and download (order alternated)."""
        if self.args.only == "restore":
            # The newest step is DURABLE (the warm-up's, then each restore's re-warming
            # save; retention drops older ones); the peer downloads one untimed s5cmd upload.
            if rep == 0:
                self.peer_upload("s5cmd", 0)
                self.samples["up_s5cmd"].clear()
                self.cpu.pop("up_s5cmd", None)
            arms: list[Callable[[], None]] = [
                lambda: self.ckptd_restore(self._step),
                lambda: self.peer_download(rep, source_rep=0),
            ]
            for arm in arms if rep % 2 == 0 else arms[::-1]:
                arm()
            return
        uploads = ["ckptd", *PEERS]
        k = rep % len(uploads)
        for arm in uploads[k:] + uploads[:k]:
            if arm == "ckptd":
                self.ckptd_upload()
            else:
                self.peer_upload(arm, rep)
        step = self.last_ckptd_step
        if rep % 2 == 0:
            self.ckptd_restore(step)
            self.peer_download(rep)
        else:
            self.peer_download(rep)
            self.ckptd_restore(step)

    # -- results -----------------------------------------------------------------------
    def summaries(self) -> dict[str, dict[str, Any]]:
        """Median/min/max per arm, plus ``up_fastest`` (the peer upload with the best median)."""
        out = {name: summarize(self.samples[name]) for name, _ in ARM_ROWS}
        have = [f"up_{p}" for p in PEERS if out[f"up_{p}"]["median"] is not None]
        if have:
            best = min(have, key=lambda p: out[p]["median"])
            out["up_fastest"] = {**out[best], "from": best}
        return out


def ratios(arms: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ratio of medians with its goal and whether it is met."""
    rows = []
    for name, num, den, goal in RATIOS:
        n = arms.get(num, {}).get("median")
        d = arms.get(den, {}).get("median")
        value = n / d if n is not None and d else None
        met = None if goal is None or value is None else value <= goal
        rows.append(
            {"name": name, "numerator": num, "denominator": den, "value": value}
            | {"goal": goal, "met": met}
        )
    return rows


def report(bench: DrainBench, versions: dict[str, str], elapsed: float) -> dict[str, Any]:
    """Print the tables and build the JSON document."""
    arms = bench.summaries()
    goal_ratios = ratios(arms)
    nbytes = sum(bench.files.values())
    rows = []
    for name, desc in [*ARM_ROWS, ("up_fastest", "fastest peer upload (by median)")]:
        s = arms.get(name)
        if s is None:
            continue
        gbps = nbytes / s["median"] / GB if s["median"] else None
        src = f" [{s['from']}]" if "from" in s else ""
        rows.append([name, desc + src, s["median"], s["min"], s["max"], gbps])
    a = bench.args
    title = (
        f"drain: {nbytes / 2**30:.2f} GiB in {len(bench.files)} rank files, {a.reps} reps, "
        f"part {a.part_size} x {a.drain_concurrency}, SeaweedFS on 127.0.0.1, dir {a.dir} "
        "(seconds; GB/s at the median)"
    )
    print_table(["arm", "what", "median", "min", "max", "GB/s"], rows, title)
    status = {None: "-", True: "met", False: "NOT met"}
    goal_rows = [
        [r["name"], r["value"], f"<= {r['goal']}" if r["goal"] else "-", status[r["met"]]]
        for r in goal_ratios
    ]
    print_table(["ratio (of medians)", "value", "goal", "status"], goal_rows, "goals")
    cpu: dict[str, dict[str, Any]] = {}
    cpu_rows = []
    for arm, pairs in bench.cpu.items():
        client = summarize([c for c, _ in pairs])
        server = summarize([sv for _, sv in pairs])
        cpu[arm] = {"client": client, "server": server}
        wall = arms[arm]["median"]
        cores = (client["median"] + server["median"]) / wall if wall else None
        cpu_rows.append([arm, wall, client["median"], server["median"], cores])
    print_table(
        ["arm", "wall", "client CPU s", "server CPU s", "cores busy"],
        cpu_rows,
        f"CPU (medians; {os.cpu_count()} cores shared by client and server; client = the "
        "daemon + this process for ckptd arms, the tool's process otherwise)",
    )
    growth = summarize([float(g) for g in bench.drain_anon_growth])
    if growth["median"] is not None:
        print(
            f"\ndaemon anonymous memory (RssAnon) growth during a drain, peak (median): "
            f"{growth['median'] / 2**20:.0f} MiB for {nbytes / 2**20:.0f} MiB drained "
            f"({a.drain_concurrency} x {a.part_size} buffers configured)"
        )
    first = ", ".join(f"{k} {v:.2f} s" for k, v in bench.first.items())
    print(f"\nwarm-up save (step 0, allocates leases): {first}")
    print(f"restore served via: {', '.join(bench.restore_paths)} (per rep)")
    log = bench.log_text()
    problems = [ln for ln in log.splitlines() if " WARNING " in ln or " ERROR " in ln]
    if problems:
        bench.notes.append(f"daemon log: {len(problems)} WARNING/ERROR lines, e.g. {problems[0]}")
    for note in bench.notes:
        print(f"note: {note}")
    print(f"setup {bench.setup_seconds:.1f} s, total {elapsed:.1f} s")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    return {
        "config": {**config, "size_bytes": nbytes, "files": bench.files, "dtype": "float32"},
        "versions": versions,
        "unit": "seconds",
        "arms": arms,
        "arm_descriptions": dict(ARM_ROWS),
        "ratios": goal_ratios,
        "cpu_seconds": cpu,
        "drain_daemon_anon_growth_bytes": growth,
        "warm_up_save": bench.first,
        "rewarm_saves_after_restart": bench.rewarm,
        "restore_served_via": bench.restore_paths,
        "daemon_log_problems": problems[:50],
        "notes": bench.notes,
        "setup_seconds": bench.setup_seconds,
        "elapsed_seconds": elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally clause runs
    t_start = time.perf_counter()
    sources = source_digest()
    sys.path.insert(0, str(REPO_ROOT))
    from tests.servers import SeaweedS3

    args.dir = args.dir.resolve()
    with run_directory(args.dir, "drain") as run_dir:
        s3 = None
        bench: DrainBench | None = None
        try:
            # The server's data on the disk under test; volumes large enough never to grow.
            s3 = SeaweedS3(run_dir / "seaweed", volume_size_limit_mb=8192).start()
            s3.make_bucket(BUCKET)
            bench = DrainBench(args, run_dir, s3)
            env = bench.env
            versions = {
                "s5cmd": tool_version([str(BIN / "s5cmd"), "version"], env),
                "aws": tool_version([*aws_command(), "--version"], env),
                "weed": tool_version([str(BIN / "weed"), "version"], env),
                "s3fs": __import__("s3fs").__version__,
            }
            nbytes = sum(a.nbytes for s in bench.states for a in s.values())
            print(
                f"state ready: {nbytes / 2**30:.2f}"
                f" GiB for {args.ranks} ranks in {bench.setup_seconds:.1f} s; starting ckptd",
                flush=True,
            )
            bench.start_daemon()
            bench.warm_up()
            for rep in range(args.reps):
                bench.rep(rep)
                done = {k: f"{v[-1]:.2f}" for k, v in bench.samples.items() if len(v) > rep}
                print(f"rep {rep + 1}/{args.reps}: {done}", flush=True)
            bench.stop_daemon()
            if source_digest() != sources:
                bench.notes.append(
                    "the daemon/client sources changed during the run: the daemon restarts "
                    "picked up different code, so the repetitions are not comparable"
                )
            doc = report(bench, versions, time.perf_counter() - t_start)
            path = write_results(args.name, doc, work_dir=args.dir)
            print(f"results: {path}")
            return 0
        except BaseException:
            if bench is not None and bench.daemon is not None:
                print("daemon log tail:\n" + bench.daemon.log_tail(), file=sys.stderr)
            raise
        finally:
            if bench is not None:
                bench.stop_daemon()
                if args.keep_log is not None:
                    with contextlib.suppress(OSError):
                        shutil.copyfile(bench.log_path, args.keep_log)
            if s3 is not None:
                s3.close()


if __name__ == "__main__":
    sys.exit(main())
