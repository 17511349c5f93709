"""The goodput simulator's costs, measured on the real stack as distributions.

One trainer of bench/goodput/job.py (``--trainer gpu-like`` or ``jax``) saving every
``--interval-steps`` steps, per arm:

- ``ckptd``: ``Client.save`` (``FixedInterval``) to a real ``ckptd serve`` that
  drains to a SeaweedFS S3 bucket on 127.0.0.1, its memory tier on;
- ``orbax``: an Orbax ``CheckpointManager`` with async saves to a local directory.

The job runs in lives: each is SIGKILLed once its last save is restorable (ckptd:
LOCAL, or DURABLE before a node loss; Orbax: finalized) and a new process restores
and trains on. A trainer-only restart leaves the daemon running (the restore comes
from its memory tier, as it would); a node restart (ckptd) SIGKILLs the daemon
too, wipes its root and shared memory and starts a new daemon on the empty root
with the same bucket (the restore comes from the bucket). Measured, from the job's
event lines (``saving``/``saved``/``step``/``local``) and the daemon's step events:

    step            a step with no save in flight (save start to LOCAL/DURABLE)
    save_blocking   save start ("saving") to save() returned ("saved")
    save_effective  sum over the steps begun before the save was LOCAL of
                    (step time - median undisturbed step time), clipped at 0 per step
    to_local        save start to LOCAL (Orbax: its finalization)
    to_durable      save start to DURABLE in the bucket, saves started on an idle
                    drain (Orbax: its finalization)
    restart         trainer SIGKILL to the new process's first step
    node_restart    daemon and trainer SIGKILL to the first step on the new daemon

Writes the costs file the simulator reads (bench/goodput/costs-<trainer>.json,
"samples" lists), prints a table (median, P10, P90) and writes the same JSON to
bench/results/goodput-costs-<trainer>.json. ``make goodput-costs`` runs the
gpu-like measurement.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from costs_calc import arm_costs, dumps, interval_of, lives, measure, plan_of, restarts, table
from report import parse

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/: common
sys.path.insert(0, str(HERE.parents[1]))  # tests.servers: the SeaweedFS server
from common import DEFAULT_WORK_DIR, print_table, write_results  # noqa: E402

JOB = "goodput"
INTERVALS = {"ckptd": 16, "orbax": 8}
"""Steps between saves (0.5 s steps): room for ckptd's upload to end before the next
save (its to_durable on an idle drain), for Orbax's finalization."""
BUCKET = "goodput-costs"
LOCAL, DURABLE = 2, 7  # ckptd.v1.StepEvent: STEP_EVENT_LOCAL, STEP_EVENT_DURABLE


class Arm:
    """One arm's job under this driver: its lives, kills and the daemon's events."""

    def __init__(self, args: argparse.Namespace, arm: str, s3: Any) -> None:
        self.args, self.arm = args, arm
        self.work = args.work_dir / arm
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.progress = self.work / "progress.log"
        self.interval = args.interval_steps or INTERVALS[arm]
        self.kills: dict[str, list[float]] = {"restart": [], "node_restart": []}
        self.reached: dict[int, tuple[float | None, float | None]] = {}
        self.daemon: Any = None
        self.cmd = [sys.executable, str(HERE / "job.py"), "--trainer", args.trainer,
                    "--arm", f"{arm}-interval", "--interval-steps", str(self.interval),
                    "--progress", str(self.progress), "--state-mib", str(args.state_mib),
                    "--compute-seconds", str(args.compute_seconds),
                    "--dir", str(self.work / "orbax")]  # fmt: skip
        if arm == "ckptd":
            from common import Daemon

            remote = [
                *("--remote", f"s3://{BUCKET}/{args.trainer}", "--node-id", "node0"),
                *("--retention-remote", "KeepLatest(2)"),
            ]
            self.daemon = Daemon(
                self.work / "root",
                self.work / "ckptd.sock",
                extra_args=["--retention-local", "KeepLatest(2)", *(remote if s3 else [])],
                env=s3.env() if s3 else None,
                log_path=self.work / "ckptd.log",
                start_timeout=120.0,
                # Room for the memory tier's kept step and the saves in flight.
                staging_budget=f"{max(512, 4 * args.state_mib)}MiB",
            )
            self.daemon.start()
            self.cmd += ["--socket", str(self.daemon.socket)]

    def run(self, plan: list[str], saves_per_life: int) -> list[list[str]]:
        """Lives ended by ``plan``'s kills ("restart" or "node_restart"), then a last
        life; each life makes ``saves_per_life`` restorable saves before its kill."""
        proc = self._spawn()
        for n, kind in enumerate([*plan, "end"]):
            stage = "durable" if kind == "node_restart" else "local"
            self._await_kill_point(proc, n, saves_per_life, stage)
            at = time.time()
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            if kind == "end":
                break
            self.kills[kind].append(at)
            if kind == "node_restart":
                self._lose_node()
            proc = self._spawn()
            print(f"{self.arm}: {kind} {len(self.kills[kind])}", flush=True)
        self._collect()
        return parse(self.progress)

    def _spawn(self) -> subprocess.Popen[bytes]:
        err = (self.work / "job.err").open("ab")
        return subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=err)

    def _await_kill_point(
        self, proc: subprocess.Popen[bytes], n: int, saves: int, stage: str
    ) -> None:
        """Wait (polling the job's event file: this is a benchmark driver) until life
        ``n`` (``proc``) made ``saves`` saves, its last one reached ``stage`` and the job is
        a step past it (no save in flight when it dies)."""
        deadline = time.monotonic() + 600.0
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = self.work / "job.err"
                sys.exit(f"{self.arm}: the job exited ({proc.returncode}): see {err}")
            found = lives(parse(self.progress))
            life = found[n] if len(found) > n else []
            made = [int(e[1]) for e in life if e[0] == "saved" and len(e) == 3]
            started = [int(e[1]) for e in life if e[0] == "saving" and len(e) == 3]
            steps = [int(e[1]) for e in life if e[0] == "step" and len(e) == 4]
            idle = bool(made) and started[-1] == made[-1]  # not inside save()
            past = idle and len(made) >= saves and steps[-1] > made[-1]
            if past and self._restorable(made[-1], stage, life):
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.arm}: no kill point in 600 s: see {self.work}")

    def _restorable(self, step: int, stage: str, life: list[list[str]]) -> bool:
        if self.daemon is None:
            return any(e[0] == "local" and int(e[1]) == step for e in life if len(e) == 3)
        return (
            self.daemon.event_time(JOB, step, DURABLE if stage == "durable" else LOCAL) is not None
        )

    def _collect(self) -> None:
        """The daemon's LOCAL and DURABLE times of every step it saw (before it dies)."""
        if self.daemon is None:
            return
        for e in self.daemon.events(JOB):
            if e.kind in (LOCAL, DURABLE):
                local, durable = self.reached.get(e.step, (None, None))
                if e.kind == LOCAL:
                    local = local or e.time_unix
                else:
                    durable = durable or e.time_unix
                self.reached[e.step] = (local, durable)

    def _lose_node(self) -> None:
        from ckptd.daemon.local.segments import recorded_dir

        self._collect()
        self.daemon.kill()
        seg_dir = recorded_dir(self.daemon.root)  # named in the root: read it first
        shutil.rmtree(self.daemon.root, ignore_errors=True)
        # A lost node's shared memory goes with it; the dead daemon's would survive.
        if seg_dir is not None:
            shutil.rmtree(seg_dir, ignore_errors=True)
        self.daemon.start()

    def close(self) -> None:
        """Stop the daemon; the checkpoints go, the event file stays."""
        if self.daemon is not None:
            self.daemon.stop()
        for name in ("orbax", "root"):
            shutil.rmtree(self.work / name, ignore_errors=True)
        os.sync()  # this arm's dirty pages are not the next arm's writeback


def costs_file(args: argparse.Namespace, arms: dict[str, Any], command: str) -> dict[str, Any]:
    """The costs file (the simulator's format) from each arm's measurement."""
    ckptd = arms.get("ckptd", {})
    top: dict[str, Any] = {
        "step": {"samples": [round(v, 6) for a in arms.values() for v in a["step"]]},
    }
    for key in ("restart", "node_restart"):
        if key in ckptd.get("costs", {}):
            top[key] = ckptd["costs"][key]
    gpu = (
        f" (a {args.compute_seconds} s wait per step standing in for the accelerator's "
        "compute, a host-side update of 1/16 of the state, a device-to-host copy per save, "
        "counted in save_blocking)"
        if args.trainer == "gpu-like"
        else ""
    )
    every = ", ".join(f"{a} every {args.interval_steps or k}" for a, k in INTERVALS.items())
    note = (
        f"Measured by bench/goodput/costs.py on a {os.cpu_count()}-CPU VM shared with "
        f"other work: the {args.trainer} trainer of bench/goodput/job.py{gpu}, a "
        f"{args.state_mib} MiB state (params and two moments), saves: {every} "
        "steps. ckptd: Client.save (FixedInterval) to a ckptd daemon, memory tier on, "
        + (
            "no bucket (to_durable = to_local, node_restart = restart: for trainer-only "
            "failures); restart:"
            if args.no_bucket
            else "draining to a SeaweedFS S3 bucket on 127.0.0.1 (its server shares the "
            "VM's CPUs, which a remote bucket does not); to_durable: saves started on an "
            "idle drain; restart:"
        )
        + " trainer SIGKILL to the new process's first step, less one "
        "undisturbed step (the simulator runs it), restored "
        "from the daemon's memory tier; node_restart: daemon and trainer SIGKILLed, the "
        "root wiped, a new daemon on the empty root, restored from the bucket (software "
        "only: no machine provisioning). orbax: CheckpointManager async saves to a "
        "directory on local disk standing in for the bucket, which flatters Orbax (a "
        "bucket is slower): to_local = to_durable = its finalization, node_restart = "
        "restart (restored from that directory; includes importing jax). step: steps "
        "with no save in flight (save start to DURABLE), both arms pooled; "
        "save_effective: the extra time, over the median such step, of the steps begun "
        "before LOCAL (clipped at 0 per step). first_saves: the save costs of each life's "
        "first and second saves (warming up), the arm's own those of the saves after them; "
        "interval_s: the median seconds between save starts of a life (the pace measured)."
    )
    if args.no_bucket and "restart" in top:
        top["node_restart"] = top["restart"]
    return {"note": note, "trainer": args.trainer, "command": command, **top,
            "arms": {arm: a["costs"] for arm, a in arms.items()}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Measure every arm, print the table, write the costs file and the results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer", choices=("gpu-like", "jax"), default="gpu-like")
    ap.add_argument("--state-mib", type=int, default=256,
                    help="the job's state (run.py's default too)")  # fmt: skip
    ap.add_argument("--compute-seconds", type=float, default=0.5,
                    help="gpu-like: the accelerator's compute per step")  # fmt: skip
    ap.add_argument("--interval-steps", type=int, default=None,
                    help="a save every this many steps (default: ckptd 16, orbax 8)")  # fmt: skip
    ap.add_argument("--arms", nargs="+", choices=("ckptd", "orbax"), default=["ckptd", "orbax"])
    ap.add_argument("--saves", type=int, default=20, help="restorable saves per arm, at least")
    ap.add_argument("--restarts", type=int, default=5, help="trainer restarts per arm")
    ap.add_argument("--node-restarts", type=int, default=3, help="node losses (ckptd)")
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR / "goodput-costs")
    ap.add_argument("--out", type=Path, default=None,
                    help="the costs file (default bench/goodput/costs-<trainer>.json)")  # fmt: skip
    ap.add_argument("--no-bucket", action="store_true",
                    help="ckptd without a bucket, as bench/goodput/run.py without --node "
                         "runs it: to_durable = to_local, no node restarts")  # fmt: skip
    ap.add_argument("--name", default=None,
                    help="bench/results/NAME.json (default goodput-costs-<trainer>)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.no_bucket and args.node_restarts:
        ap.error("--no-bucket has no node to lose: add --node-restarts 0")
    if args.state_mib < 1 or (args.interval_steps or 2) < 2 or args.saves < 1:
        ap.error("--state-mib must be >= 1, --interval-steps >= 2 and --saves >= 1")
    if min(args.restarts, args.node_restarts) < 0:
        ap.error("--restarts and --node-restarts must be >= 0")
    out = args.out or HERE / f"costs-{args.trainer}.json"
    command = " ".join(
        ["python", "bench/goodput/costs.py", *(sys.argv[1:] if argv is None else argv)]
    )
    s3 = None
    measured: dict[str, Any] = {}
    t0 = time.monotonic()
    args.work_dir = args.work_dir / args.trainer
    shutil.rmtree(args.work_dir, ignore_errors=True)  # a fresh bucket and directories
    try:
        if "ckptd" in args.arms and not args.no_bucket:
            from tests.servers import SeaweedS3

            s3 = SeaweedS3(args.work_dir / "seaweed", volume_size_limit_mb=8192).start()
            s3.make_bucket(BUCKET)
        for name in args.arms:
            arm = Arm(args, name, s3)
            plan = plan_of(args.restarts, args.node_restarts if name == "ckptd" else 0)
            try:
                events = arm.run(plan, math.ceil(args.saves / (len(plan) + 1)))
            finally:
                arm.close()
            m = measure(events, arm.reached)
            # Where each restore came from (memory: the daemon's memory tier).
            m["restore_tiers"] = [e[4] for e in events if e[0] == "restore" and len(e) == 5]
            m["interval_s"] = interval_of(events)
            kills = {
                k: restarts(events, v, statistics.median(m["step"])) for k, v in arm.kills.items()
            }
            if name == "orbax":  # its directory stands in for the bucket (see the note)
                kills["node_restart"] = kills["restart"]
            measured[name] = {**m, "costs": arm_costs(m, kills)}
            if name == "orbax":  # one commit: durable when finalized (the same samples)
                measured[name]["costs"]["to_durable"] = measured[name]["costs"]["to_local"]
            if name == "ckptd" and args.no_bucket:  # nothing to upload: local is all
                measured[name]["costs"]["to_durable"] = measured[name]["costs"]["to_local"]
    finally:
        if s3 is not None:
            s3.close()
    doc = costs_file(args, measured, command)
    out.write_text(dumps(doc))
    headers = ["arm", "cost", "median s", "P10 s", "P90 s", "n"]
    print_table(headers, table(doc), title=f"costs: {args.trainer} trainer")
    steps = {arm: statistics.median(m["step"]) for arm, m in measured.items()}
    queued = {arm: m["to_durable_queued"] for arm, m in measured.items()}
    tiers = {arm: m["restore_tiers"] for arm, m in measured.items()}
    extra = {"wall_seconds": time.monotonic() - t0, "undisturbed_step_median_s": steps,
             "to_durable_every_save_s": queued, "restore_tiers": tiers}  # fmt: skip
    path = write_results(args.name or f"goodput-costs-{args.trainer}", {**doc, **extra})
    print(f"wrote {out} and {path} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
