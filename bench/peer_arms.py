"""Peer arms for the async-save benchmarks: NVIDIA Resiliency Extension (NVRx) and DLRover.

Each arm times one peer's asynchronous save of a CPU ``dict[str, torch.Tensor]`` the way
that peer's users run it, so a ckptd benchmark can put the numbers beside ckptd's:

- :class:`NvrxAsync`: NVRx's ``AsyncCallsQueue`` (persistent worker process) running an
  ``AsyncRequest`` of ``torch.save``: what NVRx's ``TorchAsyncCheckpoint`` schedules;
- :class:`DlroverFlash`: DLRover's flash checkpoint, ``DdpCheckpointer.save_checkpoint``
  with ``StorageType.DISK`` (a copy into shared memory; its saver process writes the file).

``save`` returns the seconds the training loop was blocked; ``wait_durable`` the seconds
from the start of the last ``save`` until the peer reports it complete: written, not
fsynced, as both peers leave their ``torch.save`` file (``fsync=True`` adds a timed fsync
of the file and its directory). Both run under a one-rank gloo group (made if absent), as
under torchrun: both peers ask ``torch.distributed`` for the rank.

``python bench/peer_arms.py --mib 8``: a self-check, 3 saves per arm, the state mutated in
place right after each save returns, every step loaded back and compared bit for bit.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

State = dict[str, torch.Tensor]

POLL_S = 0.001
"""Completion polling period: the peers' own waits poll every 0.1 s (NVRx) and 3 s
(DLRover's ``wait_latest_checkpoint``), too coarse to time a save of a few MiB."""

_RUN_IDS = itertools.count()


def ensure_process_group() -> None:
    """Start a one-rank gloo group unless one exists (an in-memory store: no port, no file)."""
    if not dist.is_initialized():
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def _poll(
    what: str, start: float, timeout_s: float, done: Callable[[], bool], alive: Callable[[], bool]
) -> None:
    """Poll ``done`` every POLL_S; raise if ``alive`` turns false or ``timeout_s`` passes."""
    while not done():
        if not alive():
            raise RuntimeError(f"{what}: the peer's process died")
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"{what}: not done in {timeout_s:.0f} s")
        time.sleep(POLL_S)


class _Arm:
    """What both arms share: the directory, the last save, the wait and the load."""

    LAYOUT = "step_{step:08d}.pt"  # a step's file under the directory

    def __init__(self, directory: Path, fsync: bool, timeout_s: float) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        ensure_process_group()
        self._fsync = fsync
        self._timeout_s = timeout_s
        self._last: tuple[int, float] | None = None  # (step, perf_counter at its save's start)

    def path(self, step: int) -> Path:
        """The file of ``step``."""
        return self.directory / self.LAYOUT.format(step=step)

    def _wait(self, done: Callable[[], bool], alive: Callable[[], bool]) -> float:
        """Poll ``done`` for the last save (then fsync if asked); seconds since it started."""
        if self._last is None:
            raise RuntimeError(f"{type(self).__name__}.wait_durable: nothing saved yet")
        step, start = self._last
        _poll(f"{type(self).__name__} step {step}", start, self._timeout_s, done, alive)
        if self._fsync:
            for p in (self.path(step), self.path(step).parent):  # the bytes, then the name
                fd = os.open(p, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        return time.perf_counter() - start

    def load(self, step: int) -> State:
        """Load ``step`` from its file with ``torch.load``, as both peers read theirs (not
        DLRover's ``load_checkpoint``: it returns the shared-memory copy when there is one)."""
        state: State = torch.load(self.path(step), map_location="cpu", weights_only=True)
        return state


class NvrxAsync(_Arm):
    """NVRx async ``torch.save`` through ``AsyncCallsQueue`` (persistent worker process)."""

    def __init__(self, directory: Path, *, fsync: bool = False, timeout_s: float = 600.0) -> None:
        """Make the queue; its worker process is spawned by the first ``save``, as in NVRx."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

        super().__init__(directory, fsync, timeout_s)  # the worker asks for the rank
        self._queue = AsyncCallsQueue(persistent=True)

    def save(self, step: int, state: State) -> float:
        """Schedule the save of ``step``; returns the seconds until control came back."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

        start = time.perf_counter()
        # TorchAsyncCheckpoint.async_save, less its torch.cuda.synchronize() (torch_ckpt.py:50),
        # which fails on a CPU-only torch. Its preload_tensors() copies D2H into new host
        # tensors, the snapshot that lets training go on; on CPU, .to("cpu") returns the
        # tensor itself, so the CPU equivalent is a clone.
        snapshot = {k: v.detach().clone() for k, v in state.items()}
        self._queue.schedule_async_request(
            AsyncRequest(torch.save, (snapshot, str(self.path(step))), [])
        )
        self._last = (step, start)
        return time.perf_counter() - start

    def wait_durable(self) -> float:
        """Wait until NVRx finalizes the last save; seconds since that save started."""

        def done() -> bool:
            # Non-blocking, as a training loop calls it each step; no_dist=True because the
            # distributed variant all-reduces a CUDA tensor (core.py sync_all_async_calls).
            self._queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
            return not self._queue.get_num_unfinalized_calls()

        return self._wait(done, self._worker_alive)

    def _worker_alive(self) -> bool:
        """Whether NVRx's persistent worker runs (an exception in it ends it silently)."""
        caller = self._queue.persistent_caller
        return bool(caller and caller.process and caller.process.is_alive())

    def close(self) -> None:
        """Finish pending saves and stop the worker process."""
        if not self._worker_alive():  # none yet, or dead: close() would wait for it forever
            if self._queue.persistent_caller is not None:
                self._queue.persistent_caller.process = None
            return
        # AsyncCallsQueue.close() finalizes with no_dist=False (a CUDA all-reduce) when calls
        # are pending, so drain them here first; then it only stops the worker.
        self._queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        self._queue.close()


class DlroverFlash(_Arm):
    """DLRover flash checkpoint: ``DdpCheckpointer`` with its standalone saver process."""

    LAYOUT = "{step}/rank_0.pt"  # DdpCheckpointer's default path

    def __init__(self, directory: Path, *, fsync: bool = False, timeout_s: float = 600.0) -> None:
        """Start DLRover's saver process (as its agent does), then its checkpointer."""
        from dlrover.python.common.multi_process import SOCKET_TMP_DIR, SharedQueue
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer
        from dlrover.trainer.torch.flash_checkpoint.engine import start_async_save

        logging.getLogger("dlrover.logger").setLevel(logging.WARNING)  # INFO logs each save
        super().__init__(directory, fsync, timeout_s)
        # Its sockets (/tmp/ckpt_sock/<id>/) and shared memory (<id>_ckpt_shm_0) are named after
        # TORCHELASTIC_RUN_ID: a unique id keeps concurrent runs and stale sockets apart.
        run_id = f"ckptd-peer-{os.getpid()}-{next(_RUN_IDS)}"
        self._sock_dir = Path(SOCKET_TMP_DIR) / run_id
        # Not the engine's own fork (start_saver_process): it asks the new child at once, but
        # SharedQueue serves before it has a queue (multi_process.py), so an early put is lost
        # and the engine fails 60 s later (1 start in ~10 here). As dlrover-run does: the
        # saver first, waited for; ROLE_NAME=dlrover-trainer makes the engine use it.
        saved = {k: os.environ.get(k) for k in ("TORCHELASTIC_RUN_ID", "ROLE_NAME")}
        os.environ |= {"TORCHELASTIC_RUN_ID": run_id, "ROLE_NAME": "dlrover-trainer"}
        self._saver = multiprocessing.get_context("fork").Process(target=start_async_save)
        self._saver.daemon = True
        try:
            self._saver.start()
            q, t0, alive = SharedQueue(name="factory"), time.perf_counter(), self._saver.is_alive
            _poll("DLRover saver start", t0, 60, q.is_available, alive)
            time.sleep(0.05)  # past its bind-to-listen gap and queue-less window: fewer error logs
            _poll("DLRover saver start", t0, 60, lambda: q.qsize() >= 0, alive)  # -1: no queue
            self._ckpt = DdpCheckpointer(str(directory))
        except BaseException:
            self._saver.terminate()
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            raise
        finally:
            os.environ.update({k: v for k, v in saved.items() if v is not None})
            for k in (k for k, v in saved.items() if v is None):
                del os.environ[k]
        self._engine = self._ckpt._engine  # holds the accepted step and the shared memory
        self.skipped: list[int] = []  # dropped by DLRover: saved while its saver was writing

    def save(self, step: int, state: State) -> float:
        """Copy ``step`` into shared memory and queue its write; returns the blocked seconds."""
        from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType

        # The saver never writes step 0 (ckpt_saver.py: "if ckpt_config.step == 0: continue"),
        # and save_to_storage copies a step into memory only if it is above the last one.
        if step < 1 or (self._last is not None and step <= self._last[0]):
            raise ValueError(f"DLRover needs increasing steps >= 1, got {step}")
        start = time.perf_counter()
        self._ckpt.save_checkpoint(step, state, str(self.path(step)), StorageType.DISK)
        blocked = time.perf_counter() - start
        if self._engine.latest_step != step:
            self.skipped.append(step)
        self._last = (step, start)
        return blocked

    def wait_durable(self) -> float:
        """Wait until DLRover's tracker file names the last step; seconds since its save began."""
        if self._last is not None and self._last[0] in self.skipped:
            raise RuntimeError(f"DLRover skipped step {self._last[0]}: its saver was busy")
        # The saver writes the tracker (fsynced) after the torch.save of the file and the done
        # file, so the step it names is committed.
        tracker = self.directory / "dlrover_latest.txt"
        step = self._last[0] if self._last else 0  # _wait raises when nothing was saved

        def done() -> bool:
            text = tracker.read_text().strip() if tracker.exists() else ""
            return text.isdigit() and int(text) >= step  # empty while being rewritten

        return self._wait(done, self._saver.is_alive)

    def close(self) -> None:
        """Stop the saver process and remove the shared memory and sockets of this arm."""
        shm = self._engine._shm_handler.shared_memory
        self._engine.close()  # unmaps the shared memory in this process
        if shm is not None:
            shm.unlink()  # created here; DLRover's class keeps it off the resource tracker
        self._saver.terminate()  # it loops forever (engine.start_async_save); SIGTERM unhandled
        self._saver.join(timeout=10)
        shutil.rmtree(self._sock_dir, ignore_errors=True)


def make_state(mib: float, tensors: int = 8) -> State:
    """``tensors`` float32 tensors totaling ``mib`` MiB, random (seeded)."""
    gen, numel = torch.Generator().manual_seed(0), max(1, int(mib * 2**20) // (4 * tensors))
    return {f"t{i}": torch.randn(numel, generator=gen) for i in range(tensors)}


def _bits_equal(a: State, b: State) -> bool:
    """Same keys, dtypes, shapes and bytes."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
        for k in a
    )


def self_check(name: str, arm: NvrxAsync | DlroverFlash, mib: float, saves: int) -> None:
    """Save ``saves`` steps (state mutated right after each save returns), then check them."""
    state = make_state(mib)
    expected: dict[int, State] = {}
    for step in range(1, saves + 1):
        expected[step] = {k: v.clone() for k, v in state.items()}
        blocked = arm.save(step, state)
        for t in state.values():  # the next training step, while the write is in flight
            t.add_(1.0)
        durable = arm.wait_durable()
        print(f"{name:8s} step {step}: blocked {blocked:8.4f} s   durable {durable:8.4f} s")
    for step, want in expected.items():
        if not _bits_equal(arm.load(step), want):
            raise AssertionError(f"{name}: step {step} loaded back differs from what was saved")
    print(f"{name:8s} steps 1-{saves} loaded back bit-exact")


def main() -> int:
    """Run the self-check of each arm; 0 when all pass."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=8.0, help="state size in MiB (8 tensors)")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="parent of the temp directory")
    parser.add_argument("--arms", default="nvrx,dlrover", help="comma-separated: nvrx,dlrover")
    parser.add_argument("--fsync", action="store_true", help="add a timed fsync to durable")
    parser.add_argument("--timeout", type=float, default=120.0, help="per-save limit (s)")
    args = parser.parse_args()
    if args.mib <= 0 or args.saves < 1:
        parser.error("--mib and --saves must be positive")
    arms: dict[str, type[NvrxAsync | DlroverFlash]] = {"nvrx": NvrxAsync, "dlrover": DlroverFlash}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="peer-arms-", dir=args.dir) as tmp:
        for name in args.arms.split(","):
            arm: NvrxAsync | DlroverFlash | None = None
            try:
                arm = arms[name](Path(tmp) / name, fsync=args.fsync, timeout_s=args.timeout)
                self_check(name, arm, args.mib, args.saves)
            except Exception as e:  # one peer failing must not hide the other's result
                failures.append(f"{name}: {type(e).__name__}: {e}")
            finally:
                if arm is not None:
                    arm.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
