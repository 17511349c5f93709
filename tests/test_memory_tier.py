"""The memory tier against a real daemon: a trainer killed on a live node restarts from
the daemon's shared memory, bit-exact, and never from a copy that is not (local/memory.py).

Each restore's tier is read from the daemon's counter ``memory_tier_restores`` (the
RestoreResponse's tier, as the daemon counts it); each wait is on a status field or a
line the trainer prints, never a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.daemon.local.staging import KEPT_SUFFIX, recorded_dir
from ckptd.proto import ckptd_pb2 as pb

from .conftest import CKPTD, Daemon
from .memory_worker import state

WORKER = Path(__file__).with_name("memory_worker.py")
_alive: list[Trainer] = []


@pytest.fixture(autouse=True)
def _no_trainer_left() -> Iterator[None]:
    yield
    while _alive:
        _alive.pop().kill()


# -- helpers ---------------------------------------------------------------------------
def memory_daemon(make_daemon: Any, *args: str, **kw: Any) -> Daemon:
    """A daemon whose retention keeps every step (the tier's rules alone decide), with
    the tier's default of one step per job unless ``args`` say otherwise."""
    d: Daemon = make_daemon(
        extra_args=["--retention-local", "KeepLatest(100)", "--memory-tier-steps", "1", *args],
        **kw,
    )
    return d


class Trainer:
    """A trainer process (tests/memory_worker.py) of ``job``, driven line by line."""

    def __init__(self, daemon: Daemon, job: str) -> None:
        self.daemon = daemon
        _alive.append(self)
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(daemon.socket), job],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def do(self, command: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        assert answer, f"the trainer died on {command!r}:\n{self.daemon.log_tail()}"
        return answer

    def save(self, step: int, seed: int) -> None:
        assert self.do(f"save {step} {seed}") == "LOCAL"

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


def saved_by_trainer(daemon: Daemon, job: str, step: int, seed: int) -> None:
    """A trainer saves ``step`` of ``job``, waits LOCAL and is SIGKILLed."""
    t = Trainer(daemon, job)
    t.save(step, seed)
    t.kill()


def wait_status(daemon: Daemon, ok: Callable[[pb.DaemonStatus], bool]) -> pb.DaemonStatus:
    """Poll the daemon's status until ``ok`` (the tier's background work shows there)."""
    deadline = time.monotonic() + 60
    while True:
        st = daemon.status()
        if ok(st):
            return st
        assert time.monotonic() < deadline, f"status never got there: {st}"
        time.sleep(0.05)


def restore(daemon: Daemon, job: str, step: int | None = None) -> tuple[Any, str]:
    """A new client's restore: ``(tree, "memory" or "other")`` by the daemon's count."""
    before = daemon.status().memory_tier_restores
    tree, _ = daemon.client(job).restore(step=step)
    after = daemon.status().memory_tier_restores
    assert after - before in (0, 1)
    return tree, "memory" if after > before else "other"


def assert_exact(tree: Any, want: dict[str, np.ndarray]) -> None:
    assert sorted(tree) == sorted(want)
    for k, v in want.items():
        got = np.asarray(tree[k])
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert got.tobytes() == v.tobytes(), k


def memory_steps(daemon: Daemon, job: str) -> list[int]:
    """Steps of ``job`` that ListCheckpoints lists in the memory tier."""
    resp = daemon.connection.list_checkpoints(pb.ListCheckpointsRequest(job=job))
    return [c.step for c in resp.checkpoints if pb.TIER_MEMORY in c.tiers]


def shm_files(daemon: Daemon) -> list[Path]:
    d = recorded_dir(daemon.root)
    return sorted(d.iterdir()) if d is not None and d.is_dir() else []


def kept_segments(daemon: Daemon) -> list[Path]:
    """The segments the memory tier keeps (each has a ``.kept`` record beside it)."""
    return [
        p.with_name(p.name.removesuffix(KEPT_SUFFIX))
        for p in shm_files(daemon)
        if p.name.endswith(KEPT_SUFFIX)
    ]


def flip(segment: Path, where: int = 8192) -> None:
    """Write into a kept segment by name, as root (the tests run as root)."""
    with open(segment, "r+b") as f:
        f.seek(where)
        b = f.read(1)
        f.seek(where)
        f.write(bytes([b[0] ^ 0x40]))


# -- a trainer killed after a save restarts from memory -----------------------------
def test_a_killed_trainer_restores_from_memory_bit_exact_and_copy_on_write(
    make_daemon: Any,
) -> None:
    d = memory_daemon(make_daemon)
    saved_by_trainer(d, "mt", 5, seed=5)
    wait_status(d, lambda s: s.memory_tier_files == 1)
    assert memory_steps(d, "mt") == [5]
    tree, tier = restore(d, "mt")
    assert tier == "memory"
    assert_exact(tree, state(5))
    # The restored arrays are the trainer's: writing them changes no later restore.
    for v in tree.values():
        v[...] = np.zeros_like(v) if v.dtype != np.bool_ else True
    again, tier = restore(d, "mt")
    assert tier == "memory"
    assert_exact(again, state(5))
    assert not np.asarray(tree["f32"]).any()  # the first restore's writes stayed its own
    text = urllib.request.urlopen(d.metrics_url(), timeout=30).read().decode()
    assert 'ckptd_restores_total{tier="memory"} 2.0' in text


# -- a corrupt copy is never served -------------------------------------------------
@pytest.mark.parametrize("writer", ["alive", "exited"])
def test_a_copy_its_writer_corrupted_is_never_served(make_daemon: Any, writer: str) -> None:
    d = memory_daemon(make_daemon)
    t = Trainer(d, "bad")
    t.save(4, seed=4)
    assert t.do("corrupt") == "CORRUPTED"  # through its own mapping: the kept bytes
    if writer == "exited":
        t.kill()  # the tier checks the copy once its writer is gone, and lets it go
        wait_status(d, lambda s: s.memory_tier_files == 0)
    tree, tier = restore(d, "bad")  # while its writer lives the copy is not lent
    assert tier == "other"
    assert_exact(tree, state(4))  # from the disk
    t.kill()
    wait_status(d, lambda s: s.memory_tier_files == 0)
    st = d.status()
    assert (st.memory_tier_files, st.memory_tier_evicted) == (0, 1)
    assert memory_steps(d, "bad") == []
    assert kept_segments(d) == []  # its record went with it


def test_a_copy_corrupted_while_the_daemon_was_down_is_never_served(make_daemon: Any) -> None:
    d = memory_daemon(make_daemon)
    saved_by_trainer(d, "down", 2, seed=2)
    d.kill()
    (segment,) = kept_segments(d)
    # Root writing into /dev/shm is outside the tier's model, but a copy taken back
    # after a crash is checked before it is served: at once when its record names a
    # writer that is gone (this one), else at every restore.
    flip(segment)
    d.restart()
    tree, tier = restore(d, "down")
    assert tier == "other"
    assert_exact(tree, state(2))
    st = d.status()
    assert (st.memory_tier_files, st.memory_tier_evicted) == (0, 1)
    assert memory_steps(d, "down") == []


# -- saves come first -----------------------------------------------------------------
def test_memory_pressure_evicts_the_tier_before_a_save_waits(make_daemon: Any) -> None:
    # A save's segment is 4 MiB: the budget holds two and a half.
    d = memory_daemon(make_daemon, "--staging-budget-bytes", "10MiB", "--memory-tier-steps", "100")
    clients = [d.client("p0", staging_timeout=0.0), d.client("p1", staging_timeout=0.0)]
    for step in range(1, 6):
        for c in clients:
            # No wait for memory: a save would raise CapacityExhausted if the tier
            # held the budget.
            c.save(step, state(step)).wait("local")
            st = d.status()
            assert st.memory_tier_bytes <= st.staging_budget_bytes
            assert st.staging_allocated_bytes <= st.staging_budget_bytes
    assert all([r.state for r in c.list()] == ["LOCAL"] * 5 for c in clients)
    st = d.status()
    assert st.memory_tier_evicted > 0 and st.memory_tier_files >= 1
    for c in clients:
        tree, _ = c.restore(step=5)
        assert_exact(tree, state(5))


# -- a daemon restart ------------------------------------------------------------------
def test_a_daemon_sigkill_keeps_the_memory_tier(make_daemon: Any) -> None:
    d = memory_daemon(make_daemon)
    saved_by_trainer(d, "crash", 3, seed=3)
    wait_status(d, lambda s: s.memory_tier_files == 1)
    d.kill()
    d.restart()
    st = d.status()
    assert (st.memory_tier_files, st.memory_tier_bytes > 0) == (1, True)
    assert memory_steps(d, "crash") == [3]
    tree, tier = restore(d, "crash")
    assert tier == "memory"
    assert_exact(tree, state(3))


def test_a_clean_stop_gives_the_memory_back(make_daemon: Any) -> None:
    d = memory_daemon(make_daemon)
    saved_by_trainer(d, "stop", 3, seed=3)
    wait_status(d, lambda s: s.memory_tier_files == 1)
    assert d.stop() == 0
    assert shm_files(d) == []
    d.restart()
    assert d.status().memory_tier_files == 0
    tree, tier = restore(d, "stop")
    assert tier == "other"
    assert_exact(tree, state(3))


def test_segments_gone_after_a_daemon_sigkill_restore_from_disk(make_daemon: Any) -> None:
    d = memory_daemon(make_daemon)
    saved_by_trainer(d, "gone", 3, seed=3)
    d.kill()
    assert kept_segments(d)
    for p in shm_files(d):
        p.unlink()
    d.restart()
    assert d.status().memory_tier_files == 0
    tree, tier = restore(d, "gone")
    assert tier == "other"
    assert_exact(tree, state(3))


# -- two jobs, one budget ----------------------------------------------------------------
def test_two_jobs_share_the_tiers_cap(make_daemon: Any) -> None:
    d = memory_daemon(make_daemon, "--memory-tier-bytes", "4MiB")
    assert d.status().memory_tier_budget_bytes == 4 * 2**20
    for job, seed in (("a", 1), ("b", 2)):
        saved_by_trainer(d, job, 1, seed)
        st = d.status()
        assert 0 < st.memory_tier_bytes <= st.memory_tier_budget_bytes
        assert st.memory_tier_files == 1
    assert (memory_steps(d, "a"), memory_steps(d, "b")) == ([], [1])
    tree, tier = restore(d, "b")
    assert tier == "memory"
    assert_exact(tree, state(2))
    tree, tier = restore(d, "a")
    assert tier == "other"
    assert_exact(tree, state(1))
    assert d.status().memory_tier_bytes <= 4 * 2**20


# -- how many steps -------------------------------------------------------------------------
def test_a_newer_step_replaces_the_older_in_memory(make_daemon: Any) -> None:
    d = memory_daemon(make_daemon)
    t = Trainer(d, "newer")
    for step in (1, 2, 3):
        t.save(step, seed=step)
        assert memory_steps(d, "newer") == [step]
    t.kill()
    st = wait_status(d, lambda s: s.memory_tier_files == 1)
    assert st.memory_tier_evicted == 2
    ls = subprocess.run(
        [CKPTD, "ls", "newer", "--json", "--socket", str(d.socket)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ls.returncode == 0, ls.stderr
    assert [(r["step"], r["tiers"]) for r in json.loads(ls.stdout)] == [
        (3, ["MEMORY", "LOCAL"]),
        (2, ["LOCAL"]),
        (1, ["LOCAL"]),
    ]
    tree, tier = restore(d, "newer", step=2)
    assert tier == "other"
    assert_exact(tree, state(2))
    tree, tier = restore(d, "newer")
    assert tier == "memory"
    assert_exact(tree, state(3))


def test_memory_tier_steps_0_keeps_nothing(make_daemon: Any) -> None:
    d = memory_daemon(make_daemon, "--memory-tier-steps", "0")
    saved_by_trainer(d, "off", 1, seed=1)
    st = d.status()
    assert (st.memory_tier_files, st.memory_tier_bytes, st.memory_tier_budget_bytes) == (0, 0, 0)
    assert kept_segments(d) == []
    tree, tier = restore(d, "off")
    assert tier == "other"
    assert_exact(tree, state(1))


# -- timelines -----------------------------------------------------------------------------
def test_a_step_number_reused_on_a_new_timeline_never_serves_the_old_bytes(
    make_daemon: Any,
) -> None:
    d = memory_daemon(make_daemon, "--memory-tier-steps", "3")
    t = Trainer(d, "tl")
    t.save(3, seed=3)
    t.save(5, seed=5)
    assert t.do("restore") == "RESTORED 5"
    t.save(3, seed=33)  # a rollback saves under an older step's number: a new timeline
    t.kill()
    tree, _ = restore(d, "tl", step=3)
    assert_exact(tree, state(33))
    tree, _ = restore(d, "tl")  # the newest of the live timeline
    assert_exact(tree, state(33))
    tree, _ = restore(d, "tl", step=5)  # the abandoned step, asked for by number
    assert_exact(tree, state(5))


# -- restored memory is the trainer's -------------------------------------------------------
@pytest.mark.parametrize("daemon_crash", [False, True])
def test_arrays_restored_from_memory_never_change_under_the_trainer(
    make_daemon: Any, daemon_crash: bool
) -> None:
    d = memory_daemon(make_daemon)
    saved_by_trainer(d, "cow", 1, seed=1)
    t = Trainer(d, "cow")
    before = d.status().memory_tier_restores
    assert t.do("restore") == "RESTORED 1"
    assert d.status().memory_tier_restores == before + 1
    if daemon_crash:  # the new daemon takes the segment back, still mapped by the trainer
        d.kill()
        d.restart()
        assert d.status().memory_tier_files == 1
    # Newer saves let step 1's segment go: it must never hold a save while the
    # trainer maps it (the pages it only read are the segment's).
    for step in (2, 3, 4):
        t.save(step, seed=step)
    assert t.do("check 1") == "SAME"


def test_a_live_writer_never_changes_arrays_another_process_restored(make_daemon: Any) -> None:
    d = memory_daemon(make_daemon)
    writer = Trainer(d, "lw")
    writer.save(3, seed=3)  # LOCAL, kept in memory; the writer still maps it writable
    wait_status(d, lambda s: s.memory_tier_files == 1)
    reader = Trainer(d, "lw")
    assert reader.do("restore") == "RESTORED 3"
    assert reader.do("check 3") == "SAME"
    assert writer.do("corrupt") == "CORRUPTED"  # through its own mapping, after the restore
    assert reader.do("check 3") == "SAME"  # the restored arrays are the reader's own
    writer.kill()  # gone: the copy it changed is checked and let go, never served
    wait_status(d, lambda s: s.memory_tier_files == 0)
    tree, tier = restore(d, "lw")
    assert tier == "other"
    assert_exact(tree, state(3))


# -- another uid -------------------------------------------------------------------------------
@pytest.mark.parametrize("daemon_crash", [False, True])
def test_another_uid_never_gets_the_first_uids_segment(daemon_crash: bool) -> None:
    from .test_security import Node, two_user_daemon

    with two_user_daemon("ckmem", ["--shared-jobs", "shared-*"]) as (base, d):
        node = Node(base, d, base)
        want = float(np.arange(4096, dtype=np.float32).sum())
        assert node.run("ckptd-ta", "save", "shared-m", "1") == {"ok": True}
        wait_status(d, lambda s: s.memory_tier_files == 1)
        if daemon_crash:  # a segment taken back: its uid must be known still
            d.kill()
            d.restart()
            assert d.status().memory_tier_files == 1
        before = d.status().memory_tier_restores
        assert node.run("ckptd-tb", "restore", "shared-m") == {"ok": True, "sum": want}
        assert d.status().memory_tier_restores == before  # served from the disk
        assert node.run("ckptd-ta", "restore", "shared-m") == {"ok": True, "sum": want}
        assert d.status().memory_tier_restores == before + 1  # the tier held it all along


# -- torch DCP ---------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_dcp_reader_restores_from_memory_after_a_trainer_sigkill(make_daemon: Any) -> None:
    torch = pytest.importorskip("torch", reason="the DCP reader needs torch")
    import torch.distributed.checkpoint as dcp

    from ckptd.client.torch import CkptdReader

    from .memory_worker import torch_state

    d = memory_daemon(make_daemon)
    t = Trainer(d, "dcp")
    assert t.do("dcp-save 6 6") == "LOCAL"
    t.kill()
    wait_status(d, lambda s: s.memory_tier_files == 1)
    want = torch_state(6)
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    before = d.status().memory_tier_restores
    dcp.load(got, storage_reader=CkptdReader("dcp", socket=d.socket))
    assert d.status().memory_tier_restores > before
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k


# -- a rank from memory, another rank's file corrupt on disk ---------------------------------
def test_a_corrupt_file_of_another_rank_is_set_aside_when_one_rank_came_from_memory(
    make_daemon: Any,
) -> None:
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from .helpers import flip_byte

    d = memory_daemon(make_daemon)
    m = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    host = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)

    def clients() -> list[Any]:
        return [d.client("ranks", rank=r, node_ranks=[0, 1], world_size=2) for r in (0, 1)]

    for step in (1, 2):
        w = jax.device_put(host * step, NamedSharding(m, P("x", "y")))
        for h in [c.save(step, {"w": w}) for c in clients()]:
            h.wait("local", 60)
    assert memory_steps(d, "ranks") == [2] and d.status().memory_tier_files == 2
    flip_byte(d.root / "ranks" / "2" / "rank-00000.safetensors")
    # Rank 1's own file comes from memory; the global array needs rank 0's shards,
    # read from its file: corrupt, so step 2 is set aside and step 1 is served.
    tree, _ = clients()[1].restore()
    np.testing.assert_array_equal(np.asarray(tree["w"]), host)
    assert [e.step for e in d.events_of(pb.STEP_EVENT_SET_ASIDE, "ranks")] == [2]
    assert memory_steps(d, "ranks") == []
