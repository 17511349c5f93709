"""JAX state on CPU: ckptd save / time-to-LOCAL / restore against Orbax, in one run.

One state (``--size-gib`` of random float32 ``jax.Array`` leaves in ``--arrays``
arrays, a dict), one disk (``--dir``). Every repetition runs, for ckptd (a real
``ckptd serve``, local tier, ``KeepLatest(2)``) and for Orbax (``CheckpointManager``,
``max_to_keep=2``, async saves, ``StandardSave``) in alternating order: one save,
two saves back to back, then a cold and a warm restore onto the same sharding,
each restored leaf checked against the saved bytes. Results: a table on stdout
and ``bench/results/jax.json``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    DEFAULT_WORK_DIR,
    Daemon,
    drop_caches,
    print_table,
    run_directory,
    settle,
    summarize,
    write_results,
)

JOB = "bench-jax"
# (arm, what); ckptd arms start with "c_", Orbax arms with "o_".
ROWS: list[tuple[str, str, str | None]] = [  # (what, ckptd arm, Orbax arm)
    ("save() returns / Orbax save() blocks", "c_save", "o_block"),
    ("device-to-host copy + handoff done", "c_copied", None),
    ("save -> LOCAL / Orbax save -> finished", "c_local", "o_total"),
    ("2 saves back to back: both save() returned", "c_b2b_return", "o_b2b_return"),
    ("2 saves back to back: both LOCAL / finished", "c_b2b_local", "o_b2b_total"),
    ("restore + block_until_ready, cold cache", "c_restore_cold", "o_restore_cold"),
    ("restore + block_until_ready, warm cache", "c_restore_warm", "o_restore_warm"),
    ("info: ckptd restore(shared_memory=False), cold", "c_restore_cold_noshm", None),
]
# (goal, ckptd arm, Orbax arm, max ratio ckptd / Orbax)
GOALS: list[tuple[str, str, str, float]] = [
    ("ckptd save() <= Orbax save() blocking", "c_save", "o_block", 1.0),
    ("ckptd LOCAL <= 0.25x Orbax total", "c_local", "o_total", 0.25),
    ("ckptd restore (cold) <= 0.25x Orbax's", "c_restore_cold", "o_restore_cold", 0.25),
]
Tree = dict[str, Any]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--size-gib", type=float, help="state size in GiB (default 1; --quick 0.25)")
    p.add_argument("--arrays", type=int, default=8, help="number of arrays (default 8)")
    p.add_argument("--reps", type=int, help="measured repetitions (default 3; --quick 2)")
    p.add_argument("--devices", type=int, default=1, help="CPU devices, arrays sharded on rows")
    p.add_argument("--quick", action="store_true", help="0.25 GiB, 2 reps")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch dir (same disk)")
    p.add_argument("--seed", type=int, default=0, help="numpy default_rng seed")
    p.add_argument("--name", default="jax", help="results file bench/results/NAME.json")
    p.add_argument(
        "--trust-jax-arrays",
        action="store_true",
        help="Client(trust_jax_arrays=True): the same arrays are not copied again, and "
        "are copied after save() returns (default: copied before it returns)",
    )
    args = p.parse_args(argv)
    args.size_gib = args.size_gib or (0.25 if args.quick else 1.0)
    args.reps = args.reps or (2 if args.quick else 3)
    if args.size_gib <= 0 or args.arrays < 1 or args.reps < 1 or args.devices < 1:
        p.error("--size-gib, --arrays, --reps and --devices must be positive")
    return args


def make_state(args: argparse.Namespace) -> tuple[Tree, dict[str, np.ndarray], Tree]:
    """The jax state, its host bytes (for checks) and the restore target (ShapeDtypeStructs)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

    devices = jax.devices()
    if len(devices) < args.devices:
        raise RuntimeError(f"asked for {args.devices} CPU devices, jax has {len(devices)}")
    if args.devices == 1:
        sharding: Any = SingleDeviceSharding(devices[0])
    else:
        mesh = Mesh(np.array(devices[: args.devices]), ("x",))
        sharding = NamedSharding(mesh, PartitionSpec("x", None))
    # rows of 1024 float32, a multiple of --devices rows per array
    rows = int(args.size_gib * 2**30) // args.arrays // 4096 // args.devices * args.devices
    rows = max(rows, args.devices)
    rng = np.random.default_rng(args.seed)
    host = {f"layer{i:02d}": rng.random((rows, 1024), dtype=np.float32) for i in range(args.arrays)}
    state = {k: jax.device_put(v, sharding) for k, v in host.items()}
    jax.block_until_ready(state)
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in host.items()}
    return state, host, target


def check(tree: Any, host: dict[str, np.ndarray], target: Tree, who: str) -> None:
    """Raise unless every restored leaf is a jax array on the target's sharding with the
    saved bytes."""
    import jax

    if not isinstance(tree, dict) or sorted(tree) != sorted(host):
        raise AssertionError(f"{who}: restored tree has keys {sorted(tree)!r:.200}")
    for k, want in host.items():
        got = tree[k]
        if not isinstance(got, jax.Array) or got.sharding != target[k].sharding:
            raise AssertionError(f"{who}: leaf {k!r} is {type(got).__name__} on {got.sharding}")
        if not np.array_equal(np.asarray(got), want):
            raise AssertionError(f"{who}: leaf {k!r} differs from the saved state")


class Bench:
    """The state, both checkpointers and the samples of one run."""

    def __init__(self, args: argparse.Namespace, run_dir: Path) -> None:
        import orbax.checkpoint as ocp

        from ckptd.client import Client

        self.args, self.ocp = args, ocp
        self.samples: dict[str, list[float]] = {a: [] for _, c, o in ROWS for a in (c, o) if a}
        self.first: dict[str, float] = {}
        t0 = time.perf_counter()
        self.state, self.host, self.target = make_state(args)
        self.nbytes = sum(a.nbytes for a in self.host.values())
        self.setup_s = time.perf_counter() - t0
        self.daemon = Daemon(
            run_dir / "ckptd-root",
            run_dir / "ckptd.sock",
            staging_budget="3GiB",
            extra_args=["--retention-local", "KeepLatest(2)"],
        ).start()
        try:
            self.client = Client(
                job=JOB, socket=str(self.daemon.socket), trust_jax_arrays=args.trust_jax_arrays
            )
            self.orbax_dir = run_dir / "orbax"
            options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
            self.mngr = ocp.CheckpointManager(self.orbax_dir, options=options)
        except BaseException:
            self.daemon.stop()
            raise
        self.c_step = self.o_step = 0
        self.c_last = self.o_last = -1

    # -- ckptd -----------------------------------------------------------------
    def ckptd_save(self) -> None:
        """One save: until save() returns, until copied, until LOCAL."""
        settle()
        t0 = time.perf_counter()
        h = self.client.save(self.c_step, self.state)
        t1 = time.perf_counter()
        h.wait_copied()
        t2 = time.perf_counter()
        h.wait("local")
        t3 = time.perf_counter()
        self.samples["c_save"].append(t1 - t0)
        self.samples["c_copied"].append(t2 - t0)
        self.samples["c_local"].append(t3 - t0)
        self.c_last, self.c_step = self.c_step, self.c_step + 1

    def ckptd_b2b(self, record: bool = True) -> None:
        """Two saves issued back to back: until both returned, until both LOCAL."""
        settle()
        t0 = time.perf_counter()
        h1 = self.client.save(self.c_step, self.state)
        h2 = self.client.save(self.c_step + 1, self.state)
        t1 = time.perf_counter()
        h1.wait("local")
        h2.wait("local")
        t2 = time.perf_counter()
        if record:
            self.samples["c_b2b_return"].append(t1 - t0)
            self.samples["c_b2b_local"].append(t2 - t0)
        self.c_last, self.c_step = self.c_step + 1, self.c_step + 2

    def ckptd_restore(self, arm: str | None, cold: bool, shared_memory: bool = True) -> float:
        """Restore the newest step onto the target sharding and check it; returns seconds."""
        import jax

        if cold:
            drop_caches(self.daemon.root)
        settle()
        t0 = time.perf_counter()
        tree, _ = self.client.restore(
            step=self.c_last, target=self.target, shared_memory=shared_memory
        )
        jax.block_until_ready(tree)
        secs = time.perf_counter() - t0
        check(tree, self.host, self.target, f"ckptd restore of step {self.c_last}")
        del tree
        gc.collect()
        if arm:
            self.samples[arm].append(secs)
        return secs

    # -- Orbax -----------------------------------------------------------------
    def orbax_save(self) -> None:
        """One save: time inside save(), until wait_until_finished() returns."""
        args = self.ocp.args.StandardSave(self.state)
        settle()
        t0 = time.perf_counter()
        self.mngr.save(self.o_step, args=args)
        t1 = time.perf_counter()
        self.mngr.wait_until_finished()
        t2 = time.perf_counter()
        self.samples["o_block"].append(t1 - t0)
        self.samples["o_total"].append(t2 - t0)
        self.o_last, self.o_step = self.o_step, self.o_step + 1

    def orbax_b2b(self, record: bool = True) -> None:
        """Two save() calls back to back (the second waits for the first to finish)."""
        settle()
        t0 = time.perf_counter()
        self.mngr.save(self.o_step, args=self.ocp.args.StandardSave(self.state))
        self.mngr.save(self.o_step + 1, args=self.ocp.args.StandardSave(self.state))
        t1 = time.perf_counter()
        self.mngr.wait_until_finished()
        t2 = time.perf_counter()
        if record:
            self.samples["o_b2b_return"].append(t1 - t0)
            self.samples["o_b2b_total"].append(t2 - t0)
        self.o_last, self.o_step = self.o_step + 1, self.o_step + 2

    def orbax_restore(self, arm: str | None, cold: bool) -> float:
        """``mngr.restore(StandardRestore(target))`` of the newest step, checked; seconds."""
        import jax

        if cold:
            drop_caches(self.orbax_dir)
        settle()
        t0 = time.perf_counter()
        tree = self.mngr.restore(self.o_last, args=self.ocp.args.StandardRestore(self.target))
        jax.block_until_ready(tree)
        secs = time.perf_counter() - t0
        check(dict(tree), self.host, self.target, f"Orbax restore of step {self.o_last}")
        del tree
        gc.collect()
        if arm:
            self.samples[arm].append(secs)
        return secs

    # -- the run ---------------------------------------------------------------
    def warmup(self) -> None:
        """Untimed: two saves back to back (ckptd allocates both staging leases) and a
        restore, for each; the first single save's times are kept apart."""
        t0 = time.perf_counter()
        self.client.save(self.c_step, self.state).wait("local")
        self.first["c_first_local"] = time.perf_counter() - t0
        self.c_last, self.c_step = self.c_step, self.c_step + 1
        t0 = time.perf_counter()
        self.mngr.save(self.o_step, args=self.ocp.args.StandardSave(self.state))
        self.mngr.wait_until_finished()
        self.first["o_first_total"] = time.perf_counter() - t0
        self.o_last, self.o_step = self.o_step, self.o_step + 1
        self.ckptd_b2b(record=False)
        self.orbax_b2b(record=False)
        self.first["c_first_restore"] = self.ckptd_restore(None, cold=True)
        self.first["o_first_restore"] = self.orbax_restore(None, cold=True)

    def rep(self, i: int) -> None:
        """One repetition: saves, then restores; ckptd first on even reps, Orbax on odd."""
        groups = [
            (self.ckptd_save, self.ckptd_b2b),
            (self.orbax_save, self.orbax_b2b),
        ]
        restores = [
            lambda: (
                self.ckptd_restore("c_restore_cold", cold=True),
                self.ckptd_restore("c_restore_warm", cold=False),
                self.ckptd_restore("c_restore_cold_noshm", cold=True, shared_memory=False),
            ),
            lambda: (
                self.orbax_restore("o_restore_cold", cold=True),
                self.orbax_restore("o_restore_warm", cold=False),
            ),
        ]
        order = [0, 1] if i % 2 == 0 else [1, 0]
        for g in order:
            for arm in groups[g]:
                arm()
        for g in order:
            restores[g]()

    def close(self) -> dict[str, Any]:
        """Close the manager and client, stop the daemon; returns what to note."""
        info: dict[str, Any] = {}
        self.mngr.close()
        self.client.close()
        rc = self.daemon.stop()
        if rc not in (0, None):
            info["daemon_exit_status"] = rc
        return info


def report(bench: Bench, elapsed: float, load: tuple[list[float], list[float]]) -> dict[str, Any]:
    """Print the tables and build the JSON document."""
    import jax
    import orbax.checkpoint as ocp

    arms = {name: summarize(s) for name, s in bench.samples.items()}

    def med(arm: str | None) -> float | None:
        return arms[arm]["median"] if arm else None

    def span(arm: str | None) -> str | None:
        return f"{arms[arm]['min']:.2f}-{arms[arm]['max']:.2f}" if arm and arms[arm]["n"] else None

    goal_of = {(c, o): g for _, c, o, g in GOALS}
    status = {None: "-", True: "met", False: "NOT met"}
    rows = []
    for what, c, o in ROWS:
        cm, om = med(c), med(o)
        ratio = cm / om if cm is not None and om else None
        goal = goal_of.get((c, o or ""))
        met = None if goal is None or ratio is None else ratio <= goal
        goal_s = f"<= {goal}" if goal is not None else None
        rows.append([what, cm, span(c), om, span(o), ratio, goal_s, status[met]])
    a = bench.args
    title = (
        f"jax on CPU: {bench.nbytes / 2**30:.2f} GiB float32 in {a.arrays} arrays on "
        f"{a.devices} device(s), {a.reps} reps, dir {a.dir} (seconds, medians)"
    )
    heads = ["measurement", "ckptd", "min-max", "Orbax", "min-max", "ratio", "goal", "status"]
    print_table(heads, rows, title)
    goals = []
    for name, c, o, factor in GOALS:
        cm, om = med(c), med(o)
        ratio = cm / om if cm is not None and om else None
        met = None if ratio is None else ratio <= factor
        goals.append({"goal": name, "ckptd": cm, "orbax": om, "ratio": ratio, "max": factor})
        goals[-1]["met"] = met
    print(
        "warm-up (untimed, not in the table): "
        + ", ".join(f"{k} {v:.2f} s" for k, v in bench.first.items())
    )
    print(f"load average at start {load[0]}, at end {load[1]} (nproc {os.cpu_count()})")
    print(f"setup {bench.setup_s:.1f} s, total {elapsed:.1f} s")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    return {
        "config": {**config, "size_bytes": bench.nbytes, "dtype": "float32"},
        "setup": {
            "jax": jax.__version__,
            "orbax_checkpoint": getattr(ocp, "__version__", None),
            "jax_devices": [str(d) for d in jax.devices()],
            "sharding": str(next(iter(bench.state.values())).sharding),
            "daemon_args": bench.daemon.args[1:],
            "orbax": "CheckpointManager(max_to_keep=2, enable_async_checkpointing=True), "
            "StandardSave / StandardRestore(ShapeDtypeStruct tree), Orbax defaults otherwise",
            "loadavg_start": load[0],
            "loadavg_end": load[1],
        },
        "unit": "seconds",
        "rows": [{"what": w, "ckptd": c, "orbax": o} for w, c, o in ROWS],
        "arms": arms,
        "warmup": bench.first,
        "goals": goals,
        "setup_seconds": bench.setup_s,
        "elapsed_seconds": elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args(argv)
    if args.devices > 1:  # before jax is imported
        flag = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally clause runs
    t_start = time.perf_counter()
    load0 = [round(x, 2) for x in os.getloadavg()]
    args.dir = args.dir.resolve()
    with run_directory(args.dir, "jax") as run_dir:
        bench: Bench | None = None
        try:
            bench = Bench(args, run_dir)
            print(f"state ready: {bench.nbytes / 2**30:.2f} GiB in {bench.setup_s:.1f} s; warm-up")
            bench.warmup()
            for i in range(args.reps):
                bench.rep(i)
                last = {k: f"{v[-1]:.2f}" for k, v in bench.samples.items() if v}
                print(f"rep {i + 1}/{args.reps}: {last}", flush=True)
            done, bench = bench, None
            closed = done.close()
            load1 = [round(x, 2) for x in os.getloadavg()]
            doc = {**report(done, time.perf_counter() - t_start, (load0, load1)), **closed}
            if closed:
                print(f"note: {closed}")
            print(f"results: {write_results(args.name, doc, work_dir=args.dir)}")
            return 0
        except BaseException:
            if bench is not None:
                print("daemon log tail:\n" + bench.daemon.log_tail(), file=sys.stderr)
            raise
        finally:
            if bench is not None:
                bench.close()


if __name__ == "__main__":
    sys.exit(main())
