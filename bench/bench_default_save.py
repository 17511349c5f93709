"""The default save when everything changed: ``save()`` and time to LOCAL against their
floors, the daemon's settings that cost time, a process's first saves, and the peers.

One run, one data set per shape, one disk (``--dir``). The trainer's state is CPU
torch tensors (``torch.from_numpy`` views), each changed in place before every save
(``add_(1)``, outside the timings), as a training step changes them all:

- shapes: ``8x`` (8 tensors, ``--gib`` together) and ``transformer`` (~1,500 tensors:
  parameters and Adam's two moments, bench/transformer_arms.py);
- daemons, each with its own root, up side by side, arms rotated per repetition:
  ``default`` (memory tier and incremental saves on), ``no-memory-tier``
  (``--memory-tier-steps 0``), ``no-incremental`` (``--no-incremental``);
- floors, on the same tensors in the same repetition: ``memcpy`` (a 2-thread copy
  into a touched buffer, as the client copies) and ``write`` (that buffer written with
  O_DIRECT and fsynced into a new file on the same disk);
- first saves: each daemon arm's first and second save of a new client process
  (fresh segments), beside its steady median; ``default-reserve`` is the default
  daemon whose new client reserved its first saves' memory (``Client.reserve``);
  ``default-restored`` the default daemon whose new client restored first (a
  restarted trainer: its restore makes its first saves' memory ready);
- peers (``make bench-peers``; ``--no-peers`` leaves them out): NVRx async save and DLRover flash
  checkpoint (bench/peer_arms.py) on the same tensors in this process: the time the
  caller is blocked, and to durable (their file written and fsynced, as LOCAL is).

Ratios are of medians. The goals: ``save()`` within 1.1x of memcpy, LOCAL within
1.1x of memcpy + write, the first two saves within 1.2x of steady. A table on stdout
and ``bench/results/NAME.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_tensors import memcpy2
from common import DEFAULT_WORK_DIR, Daemon, print_table, run_directory, settle, write_results
from floors import packed_offsets, packed_size, touched_buffer, write_file
from transformer_arms import eight_array_state, leaves, transformer_state

from ckptd.client import Client

DAEMONS: dict[str, list[str]] = {
    "default": [],
    "default-reserve": [],
    "default-restored": [],
    "no-memory-tier": ["--memory-tier-steps", "0"],
    "no-incremental": ["--no-incremental"],
}
RESERVE = "reserve"
"""Arms whose new client calls ``Client.reserve(state)`` (waited for) before its first
save: the first saves' segments made and mapped ahead, as a trainer declares its state
before training."""
RESTORED = "restored"
"""Arms whose new client is a restarted trainer's: it restores the step an earlier
client of the same job saved, copies it into the state, and waits until the
memory its restore had made ahead for its first saves is ready (a restarted
trainer's first steps, its compilation among them, take longer than that)."""
SHAPES = ("8x", "transformer")
GOALS = {"save": 1.1, "local": 1.1, "first": 1.2}


def make_state(shape: str, nbytes: int, seed: int) -> dict[str, torch.Tensor]:
    """A flat dict of CPU torch tensors viewing numpy arrays of ``shape``."""
    if shape == "8x":
        tree: Any = eight_array_state(nbytes, seed)
    else:
        tree, _ = transformer_state(nbytes, np.dtype(np.float32), seed)
    arrays = list(leaves(tree))
    return {f"t{i:05d}": torch.from_numpy(a) for i, a in enumerate(arrays)}


def change(state: dict[str, torch.Tensor]) -> None:
    """Every tensor changed in place (a training step), its pages left in cache."""
    with torch.no_grad():
        for t in state.values():
            t.add_(1.0)


class Arm:
    """One daemon configuration: its daemon, a client, its samples."""

    def __init__(self, name: str, run_dir: Path, job: str) -> None:
        self.name, self.job = name, job
        root = run_dir / name
        self.daemon = Daemon(root, run_dir / f"{name}.sock", extra_args=DAEMONS[name])
        self.daemon.start()
        self.client: Client | None = None
        self.save: list[float] = []
        self.local: list[float] = []
        self.first: list[float] = []
        self.step = 0
        self.restore_s = self.ahead_s = 0.0  # a restarted trainer's restore; then ready

    def open(self, state: dict[str, torch.Tensor]) -> None:
        """A new client (a new trainer process's first saves map fresh segments, unless
        it reserves them ahead)."""
        if self.client is not None:
            self.client.close()
        self.client = Client(self.job, socket=self.daemon.socket, timeout=300.0)
        if RESERVE in self.name:
            self.client.reserve(state).result(timeout=600)
        if RESTORED in self.name:
            self.restart(state)

    def restart(self, state: dict[str, torch.Tensor]) -> None:
        """An earlier process saved; this one restores it into ``state``."""
        assert self.client is not None
        with Client(self.job, socket=self.daemon.socket, timeout=300.0) as before:
            before.save(self.step, state).wait("local", timeout=600)
        self.step += 1
        t0 = time.perf_counter()
        tree, _ = self.client.restore()
        t1 = time.perf_counter()
        with torch.no_grad():
            for k, t in state.items():
                t.copy_(torch.as_tensor(tree[k]))
        del tree
        self.client._saver.ahead.executor.submit(lambda: None).result(timeout=600)
        self.restore_s, self.ahead_s = t1 - t0, time.perf_counter() - t1

    def one(self, state: dict[str, torch.Tensor]) -> tuple[float, float]:
        """Save ``state`` under the next step: (``save()`` blocked, to LOCAL)."""
        assert self.client is not None
        t0 = time.perf_counter()
        handle = self.client.save(self.step, state)
        t1 = time.perf_counter()
        handle.wait("local", timeout=600)
        t2 = time.perf_counter()
        self.step += 1
        return t1 - t0, t2 - t0

    def close(self) -> None:
        """Close the client, stop the daemon."""
        if self.client is not None:
            self.client.close()
        self.daemon.stop()


def floors(
    state: dict[str, torch.Tensor],
    buf: Any,
    offsets: list[int],
    path: Path,
    pool: ThreadPoolExecutor,
) -> tuple[float, float]:
    """(memcpy, write + fsync) of ``state`` as it is now."""
    arrays = [t.numpy() for t in state.values()]
    t0 = time.perf_counter()
    memcpy2(arrays, buf, offsets, pool)
    t1 = time.perf_counter()
    write_file(path, buf, packed_size(arrays), direct=True)
    t2 = time.perf_counter()
    path.unlink()
    return t1 - t0, t2 - t1


def med(xs: list[float]) -> float:
    """The median (0 for none)."""
    return statistics.median(xs) if xs else 0.0


def run_shape(args: argparse.Namespace, shape: str, run_dir: Path) -> dict[str, Any]:
    """Every arm on one shape; its figures."""
    state = make_state(shape, int(args.gib * 2**30), args.seed)
    arrays = [t.numpy() for t in state.values()]
    offsets = packed_offsets(arrays)
    buf = touched_buffer(packed_size(arrays))
    pool = ThreadPoolExecutor(2)
    arms = [Arm(n, run_dir / shape, f"bench-{shape}") for n in DAEMONS]
    peers: list[Any] = []
    if args.peers:
        from peer_arms import DlroverFlash, NvrxAsync

        peers = [  # fsynced, as ckptd's LOCAL is: like for like
            NvrxAsync(run_dir / shape / "nvrx", fsync=True),
            DlroverFlash(run_dir / shape / "dlrover", fsync=True),
        ]
    memcpy: list[float] = []
    write: list[float] = []
    peer_blocked: dict[str, list[float]] = {type(p).__name__: [] for p in peers}
    peer_durable: dict[str, list[float]] = {type(p).__name__: [] for p in peers}
    try:
        # The converters' imports (a new process's client makes them on a thread while
        # its trainer starts: client/ahead.py) out of every arm's first save alike.
        import ckptd.client.leaves.torch_tensors  # noqa: F401

        for arm in arms:  # a new process's first two saves, then the steady ones
            arm.open(state)
            for _ in range(2):
                change(state)
                settle()
                arm.first.append(arm.one(state)[0])
        for rep in range(args.warmups + args.reps):
            order = arms[rep % len(arms) :] + arms[: rep % len(arms)]
            for arm in order:
                change(state)
                settle()
                s, loc = arm.one(state)
                if rep >= args.warmups:
                    arm.save.append(s)
                    arm.local.append(loc)
            change(state)
            settle()
            m, w = floors(state, buf, offsets, run_dir / shape / "floor.bin", pool)
            if rep >= args.warmups:
                memcpy.append(m)
                write.append(w)
            for p in peers:
                change(state)
                settle()
                name = type(p).__name__
                blocked = p.save(rep + 1, state)  # DLRover never writes step 0
                durable = p.wait_durable()
                if rep >= args.warmups:
                    peer_blocked[name].append(blocked)
                    peer_durable[name].append(durable)
    finally:
        for arm in arms:
            arm.close()
        for p in peers:
            p.close()
        buf.close()
        pool.shutdown()
    floor_save, floor_local = med(memcpy), med(memcpy) + med(write)
    out: dict[str, Any] = {
        "tensors": len(state),
        "bytes": sum(a.nbytes for a in arrays),
        "memcpy_s": memcpy,
        "write_s": write,
        "arms": {},
        "peers": {
            n: {"blocked_s": peer_blocked[n], "durable_s": peer_durable[n]} for n in peer_blocked
        },
    }
    for arm in arms:
        steady = med(arm.save)
        out["arms"][arm.name] = {
            "save_s": arm.save,
            "local_s": arm.local,
            "first_two_s": arm.first,
            "save_over_memcpy": med(arm.save) / floor_save,
            "local_over_floor": med(arm.local) / floor_local,
            "first_over_steady": [f / steady for f in arm.first] if steady else [],
        }
        if RESTORED in arm.name:
            out["arms"][arm.name] |= {"restore_s": arm.restore_s, "ready_after_s": arm.ahead_s}
    return out


def report(results: dict[str, Any]) -> None:
    """The tables."""
    for shape, r in results["shapes"].items():
        rows: list[list[object]] = []
        for name, a in r["arms"].items():
            firsts = ", ".join(f"{x:.2f}x" for x in a["first_over_steady"])
            rows.append([
                f"ckptd {name}", f"{med(a['save_s']) * 1e3:.0f}", f"{a['save_over_memcpy']:.2f}x",
                f"{med(a['local_s']) * 1e3:.0f}", f"{a['local_over_floor']:.2f}x", firsts,
            ])  # fmt: skip
        for name, p in r["peers"].items():
            blocked, durable = med(p["blocked_s"]), med(p["durable_s"])
            ratio = blocked / med(r["memcpy_s"])
            ms = f"{durable * 1e3:.0f}"
            rows.append([name, f"{blocked * 1e3:.0f}", f"{ratio:.2f}x", ms, "", ""])
        rows.append(["floor: memcpy", f"{med(r['memcpy_s']) * 1e3:.0f}", "1.00x", "", "", ""])
        floor_local = (med(r["memcpy_s"]) + med(r["write_s"])) * 1e3
        rows.append(["floor: memcpy + write + fsync", "", "", f"{floor_local:.0f}", "1.00x", ""])
        print_table(
            ["arm", "save() ms", "/ memcpy", "LOCAL ms", "/ floor", "1st, 2nd / steady"],
            rows,
            f"{shape}: {r['tensors']} tensors, {r['bytes'] / 2**30:.2f} GiB, every one changed",
        )


def main(argv: list[str] | None = None) -> int:
    """Run, print, write the results."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions (default 5)")
    p.add_argument("--warmups", type=int, default=2, help="unmeasured first rounds (default 2)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="subset of " + ",".join(SHAPES))
    p.add_argument(
        "--peers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="NVRx and DLRover beside (peer_arms.py; `make bench-peers`; default on)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch dir (same disk)")
    p.add_argument("--name", default="default_save", help="results: bench/results/NAME.json")
    args = p.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    if any(s not in SHAPES for s in shapes) or args.gib <= 0 or args.reps < 1:
        p.error(f"--shapes must name some of {', '.join(SHAPES)}; --gib, --reps positive")
    if args.peers:
        try:
            import dlrover  # noqa: F401
            import nvidia_resiliency_ext  # noqa: F401
        except ImportError as exc:
            p.error(f"the peers are not installed ({exc}): run `make bench-peers`, or --no-peers")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    results: dict[str, Any] = {"args": vars(args) | {"dir": str(args.dir)}, "shapes": {}}
    with run_directory(args.dir, "default-save") as run_dir:
        for shape in shapes:
            (run_dir / shape).mkdir()
            results["shapes"][shape] = run_shape(args, shape, run_dir)
    report(results)
    path = write_results(args.name, results, args.dir)
    print(f"results: {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
