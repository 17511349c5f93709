"""The per-tensor sweep: what each extra array costs a save, a commit and a restore.

The same bytes (``--mib`` MiB of float32) split into 8 ... 4,096 arrays. For each
count, interleaved repetitions of:

- ckptd: ``save()`` return; handoff to LOCAL (``save()`` + ``wait("local")``);
  restore from the local tier into shared memory plus a read of every byte; the
  daemon's CPU seconds per save (``/proc/<pid>/stat``, utime + stime);
- floors on the same arrays, the same kind of work: a 2-thread memcpy into a
  touched buffer; the memcpy plus an ``O_DIRECT`` overwrite + fsync of a
  preallocated file of the same size (ckptd overwrites spare files in place);
  an ``O_DIRECT`` read into a touched buffer plus crc32c of it.

The slope between the smallest and the largest count is the cost of one more
array on each path. Results: a table on stdout and ``bench/results/tensors.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from common import DEFAULT_WORK_DIR, Daemon, print_table, run_directory, write_results
from floors import CHUNK, packed_offsets, packed_size, round_up, touch, touched_buffer

from ckptd.client import Client
from ckptd.core import checksum

COUNTS = (8, 64, 512, 1536, 4096)


def state_of(total: int, count: int, seed: int) -> dict[str, np.ndarray]:
    """``count`` float32 arrays of ``total`` bytes together (sizes vary by 4x)."""
    rng = np.random.default_rng(seed)
    weights = rng.uniform(1, 4, count)
    sizes = np.maximum(1, (weights / weights.sum() * total / 4).astype(np.int64))
    return {f"layer{i:05d}.w": rng.standard_normal(int(n), np.float32) for i, n in enumerate(sizes)}


def memcpy2(
    arrays: list[np.ndarray], buf: Any, offsets: list[int], pool: ThreadPoolExecutor
) -> None:
    """The copy floor: arrays split in two halves by bytes, copied on two threads."""
    half = sum(a.nbytes for a in arrays) / 2
    acc, cut = 0, len(arrays)
    for i, a in enumerate(arrays):
        acc += a.nbytes
        if acc >= half:
            cut = i + 1
            break

    def copy(lo: int, hi: int) -> None:
        for a, off in zip(arrays[lo:hi], offsets[lo:hi], strict=True):
            np.copyto(np.ndarray(a.shape, a.dtype, buffer=buf, offset=off), a)

    list(pool.map(lambda r: copy(*r), [(0, cut), (cut, len(arrays))]))


def overwrite_direct(path: Path, buf: Any, length: int) -> None:
    """The write floor: pwrite over a preallocated file with O_DIRECT, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    view = memoryview(buf)
    try:
        pos, total = 0, round_up(length)
        while pos < total:
            pos += os.pwrite(fd, view[pos : min(pos + CHUNK, total)], pos)
        os.fsync(fd)
    finally:
        view.release()
        os.close(fd)


def read_direct_crc(path: Path, buf: Any, length: int) -> int:
    """The restore floor: O_DIRECT read into a touched buffer, then crc32c of it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    view = memoryview(buf)
    try:
        pos, total = 0, round_up(length)
        while pos < total:
            n = os.preadv(fd, [view[pos : min(pos + CHUNK, total)]], pos)
            if n <= 0:
                break
            pos += n
    finally:
        view.release()
        os.close(fd)
    return checksum.value(np.frombuffer(buf, np.uint8, length))


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sweep(run: Path, mib: int, reps: int, counts: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    """Every arm for every count; medians of ``reps`` interleaved repetitions."""
    daemon = Daemon(run / "root", extra_args=["--retention-local", "KeepLatest(2)"])
    daemon.start()
    assert daemon.proc is not None
    pool = ThreadPoolExecutor(2)
    out: dict[int, dict[str, Any]] = {}
    try:
        for count in counts:
            state = state_of(mib * 2**20, count, seed=count)
            arrays = list(state.values())
            offsets = packed_offsets(arrays)
            size = packed_size(arrays)
            buf = touched_buffer(size)
            floor_file = run / f"floor-{count}.bin"
            with open(floor_file, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, round_up(size))
            client = Client(f"sweep-{count}", socket=daemon.socket)
            samples: dict[str, list[float]] = {k: [] for k in ARMS}
            step = 0
            for rep in range(reps + 1):  # the first round warms segments and spare files
                cpu0 = cpu_seconds(daemon.proc.pid)
                t0 = time.perf_counter()
                handle = client.save(step, state)
                t1 = time.perf_counter()
                handle.wait("local")
                t2 = time.perf_counter()
                cpu = cpu_seconds(daemon.proc.pid) - cpu0
                t3 = time.perf_counter()
                restored, _ = client.restore(step=step)
                touch(restored)
                t4 = time.perf_counter()
                del restored
                step += 1
                f0 = time.perf_counter()
                memcpy2(arrays, buf, offsets, pool)
                f1 = time.perf_counter()
                overwrite_direct(floor_file, buf, size)
                f2 = time.perf_counter()
                read_direct_crc(floor_file, buf, size)
                f3 = time.perf_counter()
                if rep == 0:
                    continue
                for key, value in zip(
                    ARMS,
                    (t1 - t0, t2 - t0, t4 - t3, cpu, f1 - f0, f2 - f0, f3 - f2),
                    strict=True,
                ):
                    samples[key].append(value)
            client.close()
            floor_file.unlink()
            out[count] = {k: statistics.median(v) for k, v in samples.items()}
            # CPU time moves in clock ticks (10 ms): the mean over the repetitions.
            out[count]["daemon_cpu"] = statistics.fmean(samples["daemon_cpu"])
            out[count]["samples"] = samples
    finally:
        pool.shutdown()
        daemon.stop()
    return out


ARMS = (
    "save",
    "local",
    "restore",
    "daemon_cpu",
    "floor_memcpy",
    "floor_memcpy_write",
    "floor_read_crc",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="state size (MiB)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per count")
    p.add_argument("--counts", type=str, default=",".join(map(str, COUNTS)))
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch directory")
    args = p.parse_args()
    counts = tuple(int(c) for c in args.counts.split(","))
    with run_directory(args.dir, "tensors") as run:
        res = sweep(run, args.mib, args.reps, counts)
    ms = 1e3
    rows = []
    for count, r in res.items():
        rows.append(
            [
                count,
                f"{r['save'] * ms:.1f}",
                f"{r['floor_memcpy'] * ms:.1f}",
                f"{r['local'] * ms:.1f}",
                f"{r['floor_memcpy_write'] * ms:.1f}",
                f"{r['restore'] * ms:.1f}",
                f"{r['floor_read_crc'] * ms:.1f}",
                f"{r['daemon_cpu'] * ms:.1f}",
            ]
        )
    print_table(
        [
            "arrays",
            "save()",
            "memcpy",
            "LOCAL",
            "memcpy+write",
            "restore",
            "read+crc",
            "daemon cpu",
        ],
        rows,
        f"{args.mib} MiB split into N arrays, median ms of {args.reps}",
    )
    lo, hi = min(res), max(res)
    slope = {
        k: (res[hi][k] - res[lo][k]) / (hi - lo) * 1e6
        for k in ARMS  # us per extra array
    }
    print("per extra array (us): " + ", ".join(f"{k} {v:.1f}" for k, v in slope.items()))
    write_results(
        "tensors",
        {
            "args": vars(args) | {"dir": str(args.dir)},
            "by_count": {str(c): {k: v for k, v in r.items()} for c, r in res.items()},
            "per_extra_array_us": slope,
            "ratios_at": {
                str(c): {
                    "save_vs_memcpy": r["save"] / r["floor_memcpy"],
                    "local_vs_memcpy_write": r["local"] / r["floor_memcpy_write"],
                    "restore_vs_read_crc": r["restore"] / r["floor_read_crc"],
                }
                for c, r in res.items()
            },
        },
    )


if __name__ == "__main__":
    main()
