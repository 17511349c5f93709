"""The accelerator path: saving a state that lives on the GPU, and restoring it onto the GPU.

For each state size (default 1 and 8 GiB: bf16 tensors of 4 and 16 MiB), in one
process on one GPU:

- torch: ckptd ``Client.save`` (device-to-host straight into the page-locked lease)
  against DCP ``async_save`` with its ``DefaultStager`` (pinned memory, non-blocking
  copies, staging in the background) writing to the same disk. Per save: when the
  call returned, when the state was copied off the GPU (ckptd: ``wait_copied()``,
  the copies done and the handoff made; DCP: ``staging_completion``), and when it
  was on disk (ckptd: LOCAL; DCP: ``upload_completion``). Floors, same tensors: the
  device-to-host copy of each tensor into one pinned buffer (non-blocking, one
  stream), and ``cudaMemcpy``'s bandwidth (one copy of the whole size). Restore onto
  the GPU after a daemon restart with the page cache dropped: ckptd ``restore(target=)``
  against ``dcp.load``; floor: host-to-device from pinned memory.
- jax: ckptd ``Client.save`` of the same state as jax arrays against Orbax's
  ``AsyncCheckpointer`` (``StandardCheckpointHandler``): when the call returned, when
  the arrays were off the device (ckptd ``wait_copied()``; Orbax returns after its own
  device-to-host copy) and on disk; floor: ``jax.device_get``. Restore onto the device
  with a target sharding against Orbax's restore.

Each state is changed in place (torch) or replaced (jax) between saves, so every save
is a full one. Arms stop starting once ``--budget`` seconds have passed, and the JSON
is written after each, so a run cut short keeps what it measured.

``--cpu`` runs the same harness on the CPU with small states, to check the script
without a GPU (its figures mean nothing).

    python bench/bench_gpu.py [--sizes-gib 1,8] [--reps 3] [--dir PATH] [--cpu]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import numpy as np
import torch

from ckptd.client import Client

GiB, MiB = 2**30, 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-gib", default="1,8")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--frameworks", default="torch,jax")
    p.add_argument("--dir", type=Path, default=common.DEFAULT_WORK_DIR)
    p.add_argument("--budget", type=float, default=420.0, help="seconds; no arm starts after")
    p.add_argument("--cpu", action="store_true", help="check the harness on the CPU")
    p.add_argument("--name", default="gpu")
    return p.parse_args(argv)


class Run:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.device = "cpu" if args.cpu else "cuda"
        self.started = time.monotonic()
        self.results: dict[str, Any] = {"arms": {}, "device": self.device_name()}

    def device_name(self) -> str:
        return "cpu" if self.args.cpu else torch.cuda.get_device_name(0)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def sizes(self) -> list[tuple[str, int, int]]:
        """(label, tensor count, bytes each) per size; --cpu: MiB, not GiB."""
        unit = MiB if self.args.cpu else GiB
        out = []
        for s in self.args.sizes_gib.split(","):
            total = int(float(s) * unit)
            each = 4 * MiB if total <= GiB else 16 * MiB
            each = min(each, max(total // 8, 4096))
            out.append((f"{s} {'MiB' if self.args.cpu else 'GiB'}", total // each, each))
        return out

    def daemon(self, root: Path, total: int) -> common.Daemon:
        budget = f"{max(3 * total, GiB) // MiB}MiB"
        return common.Daemon(
            root, staging_budget=budget, extra_args=["--retention-local", "KeepLatest(2)"]
        ).start()  # type: ignore[return-value]

    def out_of_time(self) -> bool:
        return time.monotonic() - self.started > self.args.budget

    def record(self, key: str, value: dict[str, Any]) -> None:
        self.results["arms"][key] = value
        common.write_results(self.args.name, self.results, self.work)


# -- ckptd, either framework ----------------------------------------------------------
def ckptd_saves(
    run: Run, d: common.Daemon, job: str, changed: Callable[[], Any]
) -> list[dict[str, float]]:
    """``--reps`` full saves of ``changed()`` (after one that warms up: it page-locks
    the lease): when ``save()`` returned, the state was copied off, and was LOCAL."""
    client = Client(job, socket=d.socket, incremental=False)
    rows = []
    try:
        for step in range(run.args.reps + 1):
            tree = changed()
            t0 = time.perf_counter()
            h = client.save(step, tree)
            returned = time.perf_counter() - t0
            h.wait_copied()
            copied = time.perf_counter() - t0
            h.wait("local", 600)
            local = time.perf_counter() - t0
            if step:
                rows.append({"returned_s": returned, "copied_s": copied, "local_s": local})
    finally:
        client.close()
    return rows


def restarted(d: common.Daemon, root: Path, job: str) -> tuple[common.Daemon, Client]:
    """The daemon stopped and started again on ``root``, the page cache dropped (the
    restore that follows reads the disk), and a new client of ``job``."""
    d.stop()
    d = common.Daemon(root, d.socket, staging_budget=d.staging_budget)
    d.start()
    common.drop_caches(root)
    return d, Client(job, socket=d.socket, incremental=False)


# -- torch ---------------------------------------------------------------------------
def torch_state(n: int, each: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return {
        f"layer{i}": torch.randn(each // 2, device=device, generator=g).to(torch.bfloat16)
        for i in range(n)
    }


def torch_floors(run: Run, state: dict[str, torch.Tensor]) -> dict[str, float]:
    total = sum(t.nbytes for t in state.values())
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=run.device == "cuda")
    views, at = [], 0
    for t in state.values():
        views.append(pinned[at : at + t.nbytes].view(t.dtype).view(t.shape))
        at += t.nbytes

    def d2h() -> None:
        for v, t in zip(views, state.values(), strict=True):
            v.copy_(t, non_blocking=True)
        run.sync()

    def h2d() -> None:
        for v, t in zip(views, state.values(), strict=True):
            t.copy_(v, non_blocking=True)
        run.sync()

    whole = torch.empty(total, dtype=torch.uint8, device=run.device)

    def memcpy() -> None:
        pinned.copy_(whole, non_blocking=True)
        run.sync()

    out = {}
    for name, fn in (("d2h_pinned_s", d2h), ("h2d_pinned_s", h2d), ("memcpy_s", memcpy)):
        fn()
        out[name] = common.median_of(fn, run.args.reps)["median"]
    out["memcpy_gbps"] = total / out["memcpy_s"] / 1e9
    return out


def bump(state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        torch._foreach_add_(list(state.values()), 1.0)


def torch_ckptd(run: Run, state: dict[str, torch.Tensor], root: Path, total: int) -> dict[str, Any]:
    d = run.daemon(root, total)
    client = None
    try:

        def changed() -> dict[str, torch.Tensor]:
            bump(state)
            run.sync()
            return state

        rows = ckptd_saves(run, d, "gpu-torch", changed)
        d, client = restarted(d, root, "gpu-torch")
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        run.sync()
        t0 = time.perf_counter()
        client.restore(step=run.args.reps, target=target)
        run.sync()
        restore = time.perf_counter() - t0
        ok = all(torch.equal(target[k], state[k]) for k in state)
        tier = "memory" if d.status().memory_tier_restores else "disk"
    finally:
        if client is not None:
            client.close()
        d.stop()
    return {"saves": rows, "restore_s": restore, "restore_tier": tier, "restored_bit_exact": ok}


def torch_dcp(run: Run, state: dict[str, torch.Tensor], work: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    _patch_dcp_stager()
    pinned = run.device == "cuda"
    stager = DefaultStager(StagingOptions(pinned, False, True, pinned))
    rows = []
    try:
        for step in range(run.args.reps + 1):
            bump(state)
            run.sync()
            where = work / f"dcp-{step}"
            t0 = time.perf_counter()
            resp = dcp.async_save(
                {"model": state}, checkpoint_id=where, async_stager=stager, no_dist=True
            )
            returned = time.perf_counter() - t0
            staged_f = getattr(resp, "staging_completion", None)
            if staged_f is not None:
                staged_f.result()
            staged = time.perf_counter() - t0
            getattr(resp, "upload_completion", resp).result()
            written = time.perf_counter() - t0
            if step:
                rows.append({"returned_s": returned, "copied_s": staged, "local_s": written})
            if step < run.args.reps:
                shutil.rmtree(where, ignore_errors=True)
    finally:
        stager.close()
    last = work / f"dcp-{run.args.reps}"
    common.drop_caches(last)
    target = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
    run.sync()
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=last, no_dist=True)
    run.sync()
    restore = time.perf_counter() - t0
    ok = all(torch.equal(target["model"][k], state[k]) for k in state)
    shutil.rmtree(last, ignore_errors=True)
    return {"saves": rows, "restore_s": restore, "restored_bit_exact": ok}


def _patch_dcp_stager() -> None:
    """torch 2.11's stager copies a class through its dispatch table, which lacks the
    entry (KeyError: <class 'type'>); later releases have it, as this adds."""
    from torch.distributed.checkpoint import _state_dict_stager as sds

    def _deepcopy_atomic(x: Any, memo: Any) -> Any:
        return x

    cls = sds.StateDictStager
    shared = cls.__dict__.get("_deepcopy_dispatch")
    if isinstance(shared, dict):
        shared.setdefault(type, _deepcopy_atomic)
    if getattr(cls, "_ckptd_patched", False):
        return
    init = cls.__init__

    def patched(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        table = getattr(self, "_deepcopy_dispatch", None)
        if isinstance(table, dict):
            table.setdefault(type, _deepcopy_atomic)
            self._ckptd_table = dict(table)

    stage = cls.stage

    def staged(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The table may have been cleared since (its close() clears it).
        table, kept = getattr(self, "_deepcopy_dispatch", None), getattr(self, "_ckptd_table", None)
        if isinstance(table, dict) and kept and type not in table:
            table.update(kept)
        return stage(self, *args, **kwargs)

    cls.__init__ = patched  # type: ignore[method-assign]
    cls.stage = staged  # type: ignore[method-assign]
    cls._ckptd_patched = True  # type: ignore[attr-defined]


def torch_arm(run: Run, label: str, n: int, each: int) -> None:
    state = torch_state(n, each, run.device)
    total = n * each
    floors = torch_floors(run, state)
    ckptd = torch_ckptd(run, state, run.work / f"ckptd-torch-{total}", total)
    try:
        dcp = torch_dcp(run, state, run.work)
    except Exception as exc:  # a peer's failure is reported, not fatal to the run
        dcp = {
            "error": repr(exc)[:500],
            "saves": [],
            "restore_s": float("nan"),
            "restored_bit_exact": False,
        }
        print(f"DCP failed: {exc!r}", flush=True)
    run.record(
        f"torch {label}",
        {"tensors": n, "bytes": total, "floors": floors, "ckptd": ckptd, "dcp": dcp},
    )
    del state
    if run.device == "cuda":
        torch.cuda.empty_cache()


# -- jax -----------------------------------------------------------------------------
def jax_arm(run: Run, label: str, n: int, each: int) -> None:
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    dev = jax.devices("cpu" if run.args.cpu else "gpu")[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    keys = jax.random.split(jax.random.key(0), n)
    tree = {
        f"layer{i}": jax.device_put(
            jax.random.normal(keys[i], (each // 2,), jnp.bfloat16), sharding
        )
        for i in range(n)
    }
    step_fn = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t))
    total = n * each

    def fresh() -> Any:
        nonlocal tree
        tree = jax.block_until_ready(step_fn(tree))
        return tree

    fresh()
    # Each time of fresh arrays: jax keeps an array's host copy once it made one.
    floor = common.median_of(lambda: jax.device_get(tree), run.args.reps, fresh)["median"]

    root = run.work / f"ckptd-jax-{total}"
    d = run.daemon(root, total)
    client = None
    try:
        rows = ckptd_saves(run, d, "gpu-jax", fresh)
        d, client = restarted(d, root, "gpu-jax")
        abstract = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in tree.items()
        }
        t0 = time.perf_counter()
        got, _ = client.restore(step=run.args.reps, target=abstract)
        jax.block_until_ready(got)
        restore = time.perf_counter() - t0
        ok = all(bool(jnp.array_equal(got[k], tree[k])) for k in tree)
    finally:
        if client is not None:
            client.close()
        d.stop()
    ckptd = {"saves": rows, "restore_s": restore, "restored_bit_exact": ok}

    orows = []
    ckptr = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
    try:
        for step in range(run.args.reps + 1):
            t = fresh()
            where = (run.work / f"orbax-{step}").resolve()
            t0 = time.perf_counter()
            ckptr.save(where, args=ocp.args.StandardSave(t))
            returned = time.perf_counter() - t0
            ckptr.wait_until_finished()
            written = time.perf_counter() - t0
            if step:
                orows.append({"returned_s": returned, "copied_s": returned, "local_s": written})
            if step < run.args.reps:
                shutil.rmtree(where, ignore_errors=True)
        last = (run.work / f"orbax-{run.args.reps}").resolve()
        common.drop_caches(last)
        t0 = time.perf_counter()
        got = ckptr.restore(last, args=ocp.args.StandardRestore(abstract))
        jax.block_until_ready(got)
        orestore = time.perf_counter() - t0
        ook = all(bool(jnp.array_equal(got[k], tree[k])) for k in tree)
        shutil.rmtree(last, ignore_errors=True)
    finally:
        ckptr.close()
    orbax = {"saves": orows, "restore_s": orestore, "restored_bit_exact": ook}
    run.record(
        f"jax {label}",
        {
            "arrays": n,
            "bytes": total,
            "floors": {"device_get_s": floor},
            "ckptd": ckptd,
            "orbax": orbax,
        },
    )


def med(rows: list[dict[str, float]], key: str) -> float:
    return float(np.median([r[key] for r in rows])) if rows else float("nan")


def table(run: Run) -> None:
    out = []
    for arm, r in run.results["arms"].items():
        floor = r["floors"].get("d2h_pinned_s") or r["floors"].get("device_get_s")
        for who in ("ckptd", "dcp", "orbax"):
            if who not in r:
                continue
            rows = r[who]["saves"]
            out.append(
                [
                    arm,
                    who,
                    f"{med(rows, 'returned_s') * 1e3:.1f}",
                    f"{med(rows, 'copied_s') * 1e3:.1f}",
                    f"{med(rows, 'copied_s') / floor:.2f}x",
                    f"{med(rows, 'local_s'):.2f}",
                    f"{r[who]['restore_s']:.2f}",
                    r[who]["restored_bit_exact"],
                ]
            )
        out.append(
            [
                arm,
                "floor",
                "",
                f"{floor * 1e3:.1f}",
                "1.00x",
                "",
                f"{r['floors'].get('h2d_pinned_s', float('nan')):.2f}",
                "",
            ]
        )
    common.print_table(
        [
            "state",
            "who",
            "returned ms",
            "copied ms",
            "copied/floor",
            "on disk s",
            "restore s",
            "exact",
        ],
        out,
        f"GPU path on {run.results['device']}",
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        # Skipped, not failed: `make bench` runs every script, on machines without one too.
        print("bench_gpu: skipped: no CUDA device here (--cpu checks the harness)")
        return 0
    with common.run_directory(args.dir, "gpu") as work:
        run = Run(args, work)
        for label, n, each in run.sizes():
            for fw in args.frameworks.split(","):
                if run.out_of_time():
                    print(f"skipped {fw} {label}: past the budget", flush=True)
                    continue
                (torch_arm if fw == "torch" else jax_arm)(run, label, n, each)
                print(f"{fw} {label} done at {time.monotonic() - run.started:.0f} s", flush=True)
        table(run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
