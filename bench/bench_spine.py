"""The spine benchmark: ckptd save / time-to-LOCAL / restore against hardware floors.

One run, one data set (``--size-gib`` of random float32 in ``--arrays`` arrays,
a dict pytree), one disk (``--dir``, default ``<repo>/.bench-tmp``). Every
repetition runs the ckptd arms and the floor arms interleaved (their order
alternates between repetitions), each arm after the same ``sync`` + sleep.

Results: a table on stdout and ``bench/results/spine.json``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import gc
import mmap
import signal
import sys
import time
from collections.abc import Callable
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
from floors import (
    DirectIOUnsupported,
    memcpy_into,
    packed_offsets,
    packed_size,
    read_file,
    touch,
    touched_buffer,
    write_file,
)

from ckptd.client import Client

JOB = "bench"
GB = 1e9
# (ratio, numerator arm, denominator arms (summed), goal or None); each a ratio of medians.
RATIOS: list[tuple[str, str, tuple[str, ...], float | None]] = [
    ("save / memcpy", "save", ("memcpy",), 1.2),
    ("local / (memcpy + write)", "local", ("memcpy", "write_floor"), 1.3),
    ("restore cold+touch / read cold", "restore_cold_touch", ("read_cold_floor",), 1.5),
    ("restore cold+touch / read warm", "restore_cold_touch", ("read_warm",), None),
    ("restore warm+touch / read warm", "restore_warm_touch", ("read_warm",), None),
]
ARM_ROWS: list[tuple[str, str]] = [
    ("save", "ckptd save() return"),
    ("local", "ckptd save() -> wait('local')"),
    ("restore_cold", "ckptd restore(), cold cache"),
    ("restore_cold_touch", "ckptd restore() + touch, cold (headline)"),
    ("restore_warm", "ckptd restore(), warm cache"),
    ("restore_warm_touch", "ckptd restore() + touch, warm"),
    ("memcpy", "floor: memcpy into touched buffer"),
    ("write_buffered", "floor: pwrite + fsync, buffered"),
    ("write_direct", "floor: pwrite + fsync, O_DIRECT"),
    ("write_floor", "floor: write+fsync (faster of two)"),
    ("read_cold_buffered", "floor: read cold, buffered"),
    ("read_cold_direct", "floor: read cold, O_DIRECT"),
    ("read_cold_floor", "floor: read cold (faster of two)"),
    ("read_warm", "floor: read warm (page cache)"),
    ("touch", "info: touch of in-memory arrays"),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1.0)")
    p.add_argument("--arrays", type=int, default=8, help="number of arrays (default 8)")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions (default 5)")
    p.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_WORK_DIR,
        help=f"scratch dir on the disk under test (default {DEFAULT_WORK_DIR})",
    )
    p.add_argument("--seed", type=int, default=0, help="numpy default_rng seed")
    p.add_argument("--name", default="spine", help="results file name (bench/results/NAME.json)")
    args = p.parse_args(argv)
    if args.size_gib <= 0 or args.arrays < 1 or args.reps < 1:
        p.error("--size-gib, --arrays and --reps must be positive")
    return args


def make_state(size_bytes: int, n_arrays: int, seed: int) -> dict[str, np.ndarray]:
    """``n_arrays`` random float32 arrays of equal size (a multiple of 4 KiB), ~``size_bytes``."""
    per_array = max(1024, (size_bytes // n_arrays // 4) // 1024 * 1024)  # elements
    rng = np.random.default_rng(seed)
    return {
        f"layer{i:02d}": rng.random(per_array, dtype=np.float32).reshape(-1, 1024)
        for i in range(n_arrays)
    }


def rss_anon() -> int:
    """This process's anonymous resident memory in bytes (``RssAnon`` in /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class Spine:
    """State of one run: data, buffers, daemon, client, and the samples per arm."""

    def __init__(self, args: argparse.Namespace, run_dir: Path) -> None:
        self.args = args
        self.run_dir = run_dir
        self.root = run_dir / "root"
        self.samples: dict[str, list[float]] = {name: [] for name, _ in ARM_ROWS}
        self.anon_growth: list[int] = []
        self.notes: list[str] = []
        self.daemon: Daemon | None = None
        self.client: Client | None = None
        self.buf: mmap.mmap | None = None
        t0 = time.perf_counter()
        self.state = make_state(int(args.size_gib * 2**30), args.arrays, args.seed)
        self.arrays = list(self.state.values())
        self.nbytes = sum(a.nbytes for a in self.arrays)
        self.offsets = packed_offsets(self.arrays)
        self.expected = touch(self.state)
        # One page-aligned, touched buffer: memcpy destination, write source, read target.
        self.buf = touched_buffer(packed_size(self.arrays))
        memcpy_into(self.arrays, self.buf, self.offsets)
        self.setup_seconds = time.perf_counter() - t0

    def start(self) -> None:
        """Start the daemon and do the warm-up save (it allocates the staging lease)."""
        self.daemon = Daemon(self.root, self.run_dir / "ckptd.sock").start()
        self.client = Client(JOB, socket=self.daemon.socket, timeout=300.0)
        settle()
        self.first_save = self._save(0)

    def close(self) -> None:
        """Close the client, stop the daemon, unmap the buffer."""
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.daemon is not None:
            rc = self.daemon.stop()
            if rc not in (0, None):
                self.notes.append(f"ckptd serve exited with status {rc}")
        if self.buf is not None:
            self.buf.close()
            self.buf = None

    # -- ckptd arms --------------------------------------------------------------
    def _save(self, step: int) -> tuple[float, float]:
        assert self.client is not None
        t0 = time.perf_counter()
        h = self.client.save(step, self.state)
        t1 = time.perf_counter()
        h.wait("local", timeout=600)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0

    def _restore(self, step: int, cold: bool) -> None:
        assert self.client is not None
        if cold:
            drop_caches(self.root / JOB / str(step))
        settle()
        anon0 = rss_anon()
        t0 = time.perf_counter()
        tree, _meta = self.client.restore(step=step)
        t1 = time.perf_counter()
        got = touch(tree)
        t2 = time.perf_counter()
        growth = rss_anon() - anon0
        del tree, _meta
        gc.collect()
        if got != self.expected:
            raise RuntimeError(f"restored step {step} differs from the saved state")
        kind = "cold" if cold else "warm"
        self.samples[f"restore_{kind}"].append(t1 - t0)
        self.samples[f"restore_{kind}_touch"].append(t2 - t0)
        if cold:
            self.anon_growth.append(growth)

    def ckptd_rep(self, step: int) -> None:
        """Save ``step`` (save() return and time to LOCAL), then restore it cold and warm."""
        settle()
        save_s, local_s = self._save(step)
        self.samples["save"].append(save_s)
        self.samples["local"].append(local_s)
        self._restore(step, cold=True)
        self._restore(step, cold=False)
        drop_caches(self.root / JOB / str(step))  # as unlinking does for the floor files

    # -- floor arms ----------------------------------------------------------------
    def _time(self, arm: str, fn: Callable[[], object]) -> None:
        settle()
        t0 = time.perf_counter()
        try:
            fn()
        except DirectIOUnsupported as exc:
            note = f"{arm}: {exc}; that floor is left out"
            if note not in self.notes:
                self.notes.append(note)
            return
        self.samples[arm].append(time.perf_counter() - t0)

    def floor_rep(self, rep: int) -> None:
        """memcpy, write+fsync (buffered, O_DIRECT), read (cold buffered/direct, warm)."""
        buf = self.buf
        assert buf is not None
        self._time("memcpy", lambda: memcpy_into(self.arrays, buf, self.offsets))
        files = {
            "buffered": self.run_dir / "floor-buffered.bin",
            "direct": self.run_dir / "floor-direct.bin",
        }
        order = ["buffered", "direct"] if rep % 2 == 0 else ["direct", "buffered"]
        for kind in order:
            self._time(f"write_{kind}", self._writer(files[kind], direct=kind == "direct"))
        src = files["direct"] if files["direct"].exists() else files["buffered"]

        def cold(kind: str) -> None:
            drop_caches(src)
            self._time(f"read_cold_{kind}", self._reader(src, direct=kind == "direct"))

        def warm() -> None:  # follows a buffered read, so src is in the page cache
            self._time("read_warm", self._reader(src, direct=False))

        if rep % 2 == 0:
            cold("buffered")
            warm()
            cold("direct")
        else:
            cold("direct")
            cold("buffered")
            warm()
        self._time("touch", self._toucher())
        for path in files.values():
            path.unlink(missing_ok=True)

    def _writer(self, path: Path, *, direct: bool) -> Callable[[], None]:
        buf = self.buf
        assert buf is not None
        return lambda: write_file(path, buf, self.nbytes, direct=direct)

    def _reader(self, path: Path, *, direct: bool) -> Callable[[], int]:
        buf = self.buf
        assert buf is not None
        return lambda: read_file(path, buf, self.nbytes, direct=direct)

    def _toucher(self) -> Callable[[], int]:
        """Touch the arrays' copies in the floor buffer (views dropped after the call)."""
        buf, arrays, offsets = self.buf, self.arrays, self.offsets
        assert buf is not None

        def run() -> int:
            views = [
                np.ndarray(a.shape, a.dtype, buffer=buf, offset=o)
                for a, o in zip(arrays, offsets, strict=True)
            ]
            return touch(views)

        return run

    # -- results -------------------------------------------------------------------
    def summaries(self) -> dict[str, dict[str, Any]]:
        """Median/min/max per arm, plus the derived floors (faster of two, per median)."""
        out = {name: summarize(self.samples[name]) for name, _ in ARM_ROWS}
        for floor, parts in (
            ("write_floor", ("write_buffered", "write_direct")),
            ("read_cold_floor", ("read_cold_buffered", "read_cold_direct")),
        ):
            have = [p for p in parts if out[p]["median"] is not None]
            if have:
                best = min(have, key=lambda p: out[p]["median"])
                out[floor] = {**out[best], "from": best}
        return out

    def ratios(self, arms: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """Each ratio of medians with its goal and whether it is met."""
        rows = []
        for name, num, dens, goal in RATIOS:
            n, d = arms[num]["median"], [arms[x]["median"] for x in dens]
            value = n / sum(d) if n is not None and None not in d and sum(d) > 0 else None
            met = None if goal is None or value is None else value <= goal
            row: dict[str, Any] = {"name": name, "numerator": num, "denominator": list(dens)}
            rows.append({**row, "value": value, "goal": goal, "met": met})
        return rows


def report(spine: Spine, elapsed: float) -> dict[str, Any]:
    """Print the tables and build the JSON document."""
    arms = spine.summaries()
    ratios = spine.ratios(arms)
    rows = []
    for name, desc in ARM_ROWS:
        s = arms[name]
        gbps = spine.nbytes / s["median"] / GB if s["median"] else None
        src = f" [{s['from'].split('_')[-1]}]" if "from" in s else ""
        rows.append([name, desc + src, s["median"], s["min"], s["max"], gbps])
    save_s, local_s = spine.first_save
    firsts = [("first_save", "first save() (allocates lease)", save_s)]
    firsts.append(("first_local", "first save -> LOCAL", local_s))
    for name, desc, secs in firsts:
        rows.append([name, desc, secs, None, None, spine.nbytes / secs / GB])
    title = (
        f"spine: {spine.nbytes / 2**30:.2f} GiB in {len(spine.arrays)} float32 arrays, "
        f"{spine.args.reps} reps, dir {spine.args.dir} (seconds; GB/s at the median)"
    )
    print_table(["arm", "what", "median", "min", "max", "GB/s"], rows, title)
    status = {None: "-", True: "met", False: "NOT met"}
    goal_rows = [
        [r["name"], r["value"], f"<= {r['goal']}" if r["goal"] else "-", status[r["met"]]]
        for r in ratios
    ]
    print_table(["ratio (of medians)", "value", "goal", "status"], goal_rows, "goals")
    growth = summarize([float(g) for g in spine.anon_growth])
    if growth["median"] is not None:
        print(
            f"\nanonymous memory added by a cold restore (median): "
            f"{growth['median'] / 2**20:.0f} MiB for {spine.nbytes / 2**20:.0f} MiB restored"
        )
    for note in spine.notes:
        print(f"note: {note}")
    print(f"setup {spine.setup_seconds:.1f} s, total {elapsed:.1f} s")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(spine.args).items()}
    return {
        "config": {**config, "size_bytes": spine.nbytes, "dtype": "float32"},
        "unit": "seconds",
        "arms": arms,
        "arm_descriptions": dict(ARM_ROWS),
        "first_save": {"save": save_s, "local": local_s},
        "ratios": ratios,
        "restore_cold_anon_growth_bytes": growth,
        "notes": spine.notes,
        "setup_seconds": spine.setup_seconds,
        "elapsed_seconds": elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally clause runs
    t_start = time.perf_counter()
    args.dir = args.dir.resolve()
    with run_directory(args.dir, "spine") as run_dir:
        spine: Spine | None = None
        try:
            spine = Spine(args, run_dir)
            print(
                f"state ready: {spine.nbytes / 2**30:.2f} GiB in {spine.setup_seconds:.1f} s; "
                f"starting ckptd",
                flush=True,
            )
            spine.start()
            for rep in range(args.reps):
                if rep % 2 == 0:
                    spine.ckptd_rep(rep + 1)
                    spine.floor_rep(rep)
                else:
                    spine.floor_rep(rep)
                    spine.ckptd_rep(rep + 1)
                done = {k: f"{v[-1]:.2f}" for k, v in spine.samples.items() if v}
                print(f"rep {rep + 1}/{args.reps}: {done}", flush=True)
            spine.close()
            doc = report(spine, time.perf_counter() - t_start)
            path = write_results(args.name, doc, work_dir=args.dir)
            print(f"results: {path}")
            return 0
        except BaseException:
            if spine is not None and spine.daemon is not None:
                print("daemon log tail:\n" + spine.daemon.log_tail(), file=sys.stderr)
            raise
        finally:
            if spine is not None:
                spine.close()


if __name__ == "__main__":
    sys.exit(main())
