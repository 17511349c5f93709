"""Incremental saves on a LoRA-shaped state: ckptd incremental vs ckptd full vs DCP
(torch) and Orbax (jax), in one run, on the same states.

The state (``--frozen-gib`` of frozen float32 weights in ``--frozen-arrays`` arrays,
plus ``--adapter-mib`` of adapters with their Adam moments) is built once per
framework: torch CPU tensors (the adapters updated in place, as an optimizer does)
and jax arrays (the adapters replaced by new arrays each step, as an optax update
does). ``--saves`` continuous saves per arm, the arms interleaved save by save; each
save waits for its arm's previous one to be LOCAL (DCP: its future; Orbax:
``wait_until_finished``), so arms never share the disk. Per save:

- ``block``: until ``save()`` returns (the trainer is blocked);
- ``copied``: until the state is copied out and the trainer may change or donate it
  (ckptd: ``handle.wait_copied()``, what ckptd's Orbax ``CheckpointManager.save``
  waits for; trusted jax arrays are copied on a client thread after ``save()`` returns;
  DCP's ``async_save`` and Orbax's ``save`` return once copied);
- ``local``: until the step is on the local disk, fsynced (ckptd: LOCAL);
- ``durable``: ckptd's DURABLE in a SeaweedFS bucket on 127.0.0.1 (``--no-bucket``
  skips it); DCP and Orbax have no drain of their own;
- ``written``: bytes of the step's files on the local disk (ckptd: its rank files,
  which an incremental step's references do not repeat; DCP/Orbax: the step's
  directory);
- ``uploaded``: bytes the drain put in the bucket for the step (its rank files);
- ``changed``: bytes of the arrays that changed since the previous save (the floor
  of ``written`` and ``uploaded``).

Then the newest step of each arm is restored from disk after a daemon restart (the
memory tier empty), with the older steps evicted (``KeepLatest(2)``: the incremental
chain's first full step stays, referenced): twice, the arms in reverse order the
second time, the page cache dropped before each; the faster of the two is reported.
Goals: ``written`` and ``uploaded`` <= 1.1x ``changed``; ckptd incremental ``copied``
<= 0.1x ckptd full's. A table on stdout and ``bench/results/incremental.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
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
    source_digest,
    write_results,
)

BUCKET = "bench-incremental"
ARMS = {
    "torch": ("incremental", "digests", "full", "dcp"),
    "jax": ("incremental", "digests", "full", "orbax"),
}
"""``incremental``: ``trust_torch_versions=True`` / ``trust_jax_arrays=True`` (unchanged
tensors, the same jax arrays, neither copied nor hashed). ``digests``: ckptd's default
on CPU (every tensor and array copied, the daemon compares SHA-256). ``full``:
``incremental=False``."""
CKPTD_ARMS = ("incremental", "digests", "full")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frozen-gib", type=float, default=2.0)
    p.add_argument("--frozen-arrays", type=int, default=500)
    p.add_argument("--adapter-mib", type=float, default=32.0)
    p.add_argument("--saves", type=int, default=20)
    p.add_argument("--frameworks", default="torch,jax")
    p.add_argument("--no-bucket", action="store_true", help="no SeaweedFS: no DURABLE")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORK_DIR)
    p.add_argument("--name", default="incremental")
    return p.parse_args(argv)


def lora_arrays(args: argparse.Namespace, seed: int) -> tuple[dict[str, np.ndarray], list[str]]:
    """Frozen weights and adapters laid out as a PEFT model's state dict is (each
    layer's frozen weights, then its adapters), then the adapters' Adam moments (as
    an optimizer's state dict: together); the keys of what training changes."""
    rng = np.random.default_rng(seed)
    layers, n = 64, args.frozen_arrays
    per = int(args.frozen_gib * 2**30) // n // 4
    per_adapter = int(args.adapter_mib * 2**20) // (layers * 2 * 3) // 4
    state: dict[str, np.ndarray] = {}
    trained: list[str] = []
    each = max(n // layers, 1)
    for i in range(n):
        layer = min(i // each, layers - 1)
        state[f"model.{layer:02d}.w{i:04d}"] = rng.standard_normal(per, np.float32)
        if i == n - 1 or (i % each == each - 1 and layer < layers - 1):  # its last weight
            for ab in ("a", "b"):
                key = f"model.{layer:02d}.lora_{ab}"
                state[key] = rng.standard_normal(per_adapter, np.float32)
                trained.append(key)
    for key in list(trained):
        for moment in ("m", "v"):
            state[f"optim.{key}.{moment}"] = rng.standard_normal(per_adapter, np.float32)
            trained.append(f"optim.{key}.{moment}")
    return state, trained


def nbytes_of(value: Any) -> int:
    return int(value.nbytes) if hasattr(value, "nbytes") else int(value.numel() * 4)


def du(path: Path) -> int:
    """Bytes of the files under ``path`` (their sizes, not blocks)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _equal(a: Any, b: np.ndarray) -> bool:
    """Bit-exact, without copying either (NaN-safe: bytes, not values)."""
    x = np.asarray(a)
    return x.shape == b.shape and np.array_equal(x.view(np.uint8), b.view(np.uint8))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Run:
    """One framework's arms: its state, its writers, its samples."""

    def __init__(
        self, fw: str, args: argparse.Namespace, run: Path, daemon: Daemon, full: Daemon
    ) -> None:
        from ckptd.client import Client

        self.fw, self.args, self.run, self.daemon = fw, args, run, daemon
        self.daemons = {arm: full if arm == "full" else daemon for arm in ARMS[fw]}
        arrays, self.trained = lora_arrays(args, seed=35)
        self.changed = sum(arrays[k].nbytes for k in self.trained)
        self.total = sum(a.nbytes for a in arrays.values())
        if fw == "torch":
            import torch

            self.state: dict[str, Any] = {k: torch.from_numpy(v) for k, v in arrays.items()}
        else:
            import jax.numpy as jnp

            self.state = {k: jnp.asarray(v) for k, v in arrays.items()}
        del arrays
        self.clients = {
            arm: Client(
                f"{fw}-{arm}",
                socket=self.daemons[arm].socket,
                incremental=arm != "full",
                trust_torch_versions=arm == "incremental",
                trust_jax_arrays=arm == "incremental",
            )
            for arm in ARMS[fw]
            if arm in CKPTD_ARMS
        }
        self.samples: dict[str, dict[str, list[float]]] = {a: {} for a in ARMS[fw]}
        self.pending: dict[str, Any] = {}
        self.tiers: dict[str, str] = {}
        """The tier each ckptd arm's restore came from."""
        self.mgr: Any = None
        if fw == "jax":
            import orbax.checkpoint as ocp

            opts = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
            self.mgr = ocp.CheckpointManager(run / "orbax", options=opts)

    def add(self, arm: str, key: str, value: float | None) -> None:
        if value is not None:
            self.samples[arm].setdefault(key, []).append(float(value))

    def train_step(self) -> None:
        """The adapters and their moments change; the frozen weights do not."""
        if self.fw == "torch":
            for key in self.trained:
                self.state[key].add_(1e-3)
        else:
            for key in self.trained:
                self.state[key] = self.state[key] + 1e-3

    def save(self, arm: str, step: int) -> None:
        gc.collect()
        if arm in CKPTD_ARMS:
            self._save_ckptd(arm, step)
        elif arm == "dcp":
            self._save_dcp(step)
        else:
            self._save_orbax(step)

    def _save_ckptd(self, arm: str, step: int) -> None:
        client = self.clients[arm]
        t0 = time.perf_counter()
        handle = client.save(step, self.state)
        t1 = time.perf_counter()
        handle.wait_copied()
        self.add(arm, "copied", time.perf_counter() - t0)
        handle.wait("local", timeout=600)
        t2 = time.perf_counter()
        self.add(arm, "block", t1 - t0)
        self.add(arm, "local", t2 - t0)
        root = self.daemons[arm].root / client.job / str(step)
        manifest = json.loads((root / "manifest.json").read_text())
        written = sum(int(r["size"]) for r in manifest["ranks"])
        self.add(arm, "written", written)
        self.add(arm, "changed", self.changed if step > 1 else self.total)
        if not self.args.no_bucket and arm != "full":
            handle.wait("durable", timeout=600)
            self.add(arm, "durable", time.perf_counter() - t0)
            self.add(arm, "uploaded", written)

    def _save_dcp(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        where = self.run / f"dcp-{step}"
        writer = dcp.FileSystemWriter(where, sync_files=True)
        t0 = time.perf_counter()
        fut = dcp.async_save(self.state, storage_writer=writer)
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        self.add("dcp", "block", t1 - t0)
        self.add("dcp", "copied", t1 - t0)
        self.add("dcp", "local", t2 - t0)
        self.add("dcp", "written", du(where))
        self.add("dcp", "changed", self.changed if step > 1 else self.total)
        old = self.run / f"dcp-{step - 2}"  # DCP keeps what the caller keeps: the newest two
        shutil.rmtree(old, ignore_errors=True)

    def _save_orbax(self, step: int) -> None:
        import orbax.checkpoint as ocp

        t0 = time.perf_counter()
        self.mgr.save(step, args=ocp.args.StandardSave(self.state))
        t1 = time.perf_counter()
        self.mgr.wait_until_finished()
        t2 = time.perf_counter()
        self.add("orbax", "block", t1 - t0)
        self.add("orbax", "copied", t1 - t0)
        self.add("orbax", "local", t2 - t0)
        self.add("orbax", "written", du(self.run / "orbax" / str(step)))
        self.add("orbax", "changed", self.changed if step > 1 else self.total)

    def restore(self, arm: str, step: int) -> float:
        """The newest step from disk, cold; returns seconds; checked bit-exact."""
        want = {k: np.asarray(v) for k, v in self.state.items()}  # views: no copies
        if arm in CKPTD_ARMS:
            from ckptd.client import Client

            d = self.daemons[arm]
            drop_caches(d.root)
            served = d.status().memory_tier_restores
            with Client(f"{self.fw}-{arm}", socket=d.socket) as c:
                t0 = time.perf_counter()
                got, _ = c.restore(step=step)
                seconds = time.perf_counter() - t0
                same = all(_equal(got[k], want[k]) for k in want)
                del got
            # Where it came from: the memory tier (segments outlive a daemon restart) or disk.
            memory = d.status().memory_tier_restores > served or self.tiers.get(arm) == "memory"
            self.tiers[arm] = "memory" if memory else "disk"
        elif arm == "dcp":
            import torch
            import torch.distributed.checkpoint as dcp

            target = {k: torch.empty_like(v) for k, v in self.state.items()}
            drop_caches(self.run / f"dcp-{step}")
            t0 = time.perf_counter()
            dcp.load(target, storage_reader=dcp.FileSystemReader(self.run / f"dcp-{step}"))
            seconds = time.perf_counter() - t0
            same = all(_equal(target[k].numpy(), want[k]) for k in want)
            del target
        else:
            import orbax.checkpoint as ocp

            drop_caches(self.run / "orbax")
            t0 = time.perf_counter()
            got = self.mgr.restore(step, args=ocp.args.StandardRestore(self.state))
            seconds = time.perf_counter() - t0
            same = all(_equal(got[k], want[k]) for k in want)
            del got
        if not same:
            raise SystemExit(f"{self.fw} {arm}: the restored step {step} differs from the saved")
        return seconds

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        if self.mgr is not None:
            self.mgr.close()


def run_all(args: argparse.Namespace, run: Path, s3: Any) -> dict[str, Any]:
    extra = ["--retention-local", "KeepLatest(2)"]
    # The full arms drain to no bucket: 2 GiB a save would fill the disk under the
    # bucket's server (it reclaims deleted objects' space only when vacuumed); what
    # they would upload is what they write.
    # Two segments per job (the memory tier's and the next save's) for two jobs of
    # ~2 GiB: the bench process, the daemons' memory and DCP's or Orbax's copies
    # must fit the machine together.
    image = args.frozen_gib + args.adapter_mib / 1024
    full = Daemon(
        run / "root-full",
        run / "full.sock",
        staging_budget=f"{2 * image + 0.5:.1f}GiB",
        extra_args=extra,
    ).start()
    # Two jobs there (trusted tokens, and digests): each keeps its newest
    # step's segment and saves into the other, which holds the step before (the copy
    # skip needs it to stay that job's).
    budget = f"{4 * image + 0.5:.1f}GiB"
    env = None
    if s3 is not None:
        extra += ["--remote", f"s3://{BUCKET}/ckpt", "--retention-remote", "KeepLatest(2)"]
        env = s3.env()
    daemon = Daemon(
        run / "root", run / "ckptd.sock", staging_budget=budget, extra_args=extra, env=env
    ).start()
    out: dict[str, Any] = {"frameworks": {}, "command": daemon.args}
    try:
        for fw in args.frameworks.split(","):
            if fw == "torch":
                import torch.distributed as dist

                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
                if not dist.is_initialized():
                    dist.init_process_group("gloo", rank=0, world_size=1)
            r = Run(fw, args, run, daemon, full)
            print(f"{fw}: {r.total / 2**30:.2f} GiB, {r.changed / 2**20:.1f} MiB change per step")
            arms = ARMS[fw]
            for step in range(1, args.saves + 1):
                if step > 1:
                    r.train_step()
                order = arms if step % 2 else tuple(reversed(arms))
                for arm in order:
                    r.save(arm, step)
                print(f"{fw} save {step}/{args.saves} done", flush=True)
            for d in (daemon, full):
                d.stop()  # the memory tier empties: restores read the disk
                d.start()
            # Two rounds, the second in reverse order, each restore from a dropped page
            # cache: the restores first after the restart ran slower whichever arm
            # they were (cause not found), so no arm gets the first place every time.
            rounds: dict[str, list[float]] = {arm: [] for arm in arms}
            for order in (arms, tuple(reversed(arms))):
                for arm in order:
                    rounds[arm].append(r.restore(arm, args.saves))
            restore = {arm: min(t) for arm, t in rounds.items()}
            out["frameworks"][fw] = {
                "total_bytes": r.total,
                "changed_bytes": r.changed,
                "samples": r.samples,
                "restore_seconds": restore,
                "restore_rounds": rounds,
                "restore_tiers": r.tiers,
            }
            r.close()
            del r  # its state (GiBs) goes before the next framework's is built
            gc.collect()
    finally:
        daemon.stop()
        full.stop()
    return out


def report(res: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    rows: list[list[Any]] = []
    checks: dict[str, Any] = {}
    for fw, got in res["frameworks"].items():
        for arm, s in got["samples"].items():

            def med(key: str, s: dict[str, list[float]] = s) -> float | None:
                later = s.get(key, [])[1:]  # the first save is full in every arm
                return statistics.median(later) if later else None

            written, changed = med("written"), med("changed")
            rows.append(
                [
                    f"{fw} {arm}",
                    med("block"),
                    med("copied"),
                    med("local"),
                    med("durable"),
                    None if written is None else written / 2**20,
                    None if med("uploaded") is None else med("uploaded") / 2**20,  # type: ignore[operator]
                    None if changed is None else changed / 2**20,
                    got["restore_seconds"][arm],
                ]
            )
            if arm in ("incremental", "digests") and written and changed:
                full = got["samples"]["full"]
                checks[f"{fw} {arm}"] = {
                    "written_over_changed": written / changed,
                    "block_over_full": med("block") / statistics.median(full["block"][1:]),  # type: ignore[operator]
                    "copied_over_full": med("copied") / statistics.median(full["copied"][1:]),  # type: ignore[operator]
                }
    print_table(
        [
            "arm",
            "block s",
            "copied s",
            "local s",
            "durable s",
            "written MiB",
            "uploaded MiB",
            "changed MiB",
            "restore s",
        ],
        rows,
        title=f"LoRA-shaped state, {args.frozen_gib} GiB frozen, medians of saves 2..{args.saves}",
    )
    for fw, got in res["frameworks"].items():
        print(f"{fw} restores came from: {got['restore_tiers']}")
    print("goals: written, uploaded <= 1.1x changed; incremental copied <= 0.1x full")
    print(json.dumps(checks, indent=1))
    return {"rows": rows, "checks": checks, **res}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sources = source_digest()
    args.dir = args.dir.resolve()
    sys.path.insert(0, str(REPO_ROOT))
    with run_directory(args.dir, "incremental") as run:
        s3 = None
        try:
            if not args.no_bucket:
                from tests.servers import SeaweedS3

                s3 = SeaweedS3(run / "seaweed", volume_size_limit_mb=8192).start()
                s3.make_bucket(BUCKET)
            res = run_all(args, run, s3)
        finally:
            if s3 is not None:
                s3.stop()
    doc = report(res, args)
    doc.update(benchmark="incremental", args=vars(args) | {"dir": str(args.dir)})
    if source_digest() != sources:
        print("the sources changed during the run: results not written")
        return 1
    write_results(args.name, doc, args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
