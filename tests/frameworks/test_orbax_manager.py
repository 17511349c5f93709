"""ckptd's Orbax ``CheckpointManager`` (Orbax's v0 API, what MaxText calls) against a
real daemon, driven by Orbax's own args classes, policies and jax arrays.

- Round trips of every args type MaxText uses (``StandardSave``/``PyTreeSave``/
  ``JsonSave`` in a ``Composite``, one unnamed item), restored with
  ``StandardRestore``, ``PyTreeRestore`` (``restore_args`` shardings, another
  sharding, ``partial_restore``), ``JsonRestore``, only some items, or none;
  ``metadata``/``item_metadata``; Orbax's errors and refusals.
- ``should_save``: Orbax's save decision policies (interval, specific steps,
  continuous) decide with ckptd's state; preemption through jax's own sync point
  (a real SIGTERM in a ``jax.distributed`` process) saves, waits for the bucket
  and stops.
- A training loop (tests/frameworks/orbax_train.py) SIGKILLed right after a save
  reached LOCAL resumes bit-exact; and after the node's disk is lost (a fresh
  daemon, wiped root, the same ``file://`` bucket).
- Two jax processes with a global mesh across them, each handing its own shards
  to its node's daemon (two daemons) or to one shared daemon: save, SIGKILL,
  resume bit-exact through the agreed step; with replica 0 only, the node that
  saved no copy of the replicated arrays reads them from the bucket.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ckptd.client import SaveHandle  # noqa: E402
from ckptd.client import orbax as ckptd_orbax  # noqa: E402
from ckptd.core.errors import InvalidArgument, TreeMismatch  # noqa: E402
from ckptd.proto import ckptd_pb2 as pb  # noqa: E402

from ..conftest import Daemon, RemoteTarget  # noqa: E402
from ..test_remote_tier import remote_daemon  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
policies = ocp.checkpoint_managers


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))


def state(seed: int) -> dict[str, Any]:
    """A small train state: sharded and replicated jax arrays, numpy, scalars."""
    m = mesh()
    w = np.arange(8 * 6, dtype=np.float32).reshape(8, 6) * (seed + 1)
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(m, P("x", "y"))),
            "b": jax.device_put(np.full(6, seed, np.float32), NamedSharding(m, P())),
        },
        "opt": [jnp.asarray(np.arange(4, dtype=np.int32) + seed), np.ones(3, np.float64)],
        "step": seed,
        "name": "tiny",
    }


def abstract(tree: Any) -> Any:
    """The tree with each jax leaf as a ShapeDtypeStruct carrying its sharding."""
    return jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        tree,
    )


def assert_equal(got: Any, want: Any) -> None:
    """Same structure, leaves equal bit for bit (jax arrays on the same sharding)."""
    g_leaves, g_def = jax.tree_util.tree_flatten(got)
    w_leaves, w_def = jax.tree_util.tree_flatten(want)
    assert g_def == w_def, (g_def, w_def)
    for g, w in zip(g_leaves, w_leaves, strict=True):
        if isinstance(w, jax.Array):
            assert isinstance(g, jax.Array) and g.sharding == w.sharding, (g, w)
        if hasattr(w, "dtype"):
            assert np.asarray(g).dtype == np.asarray(w).dtype
            assert np.array_equal(np.asarray(g), np.asarray(w))
        else:
            assert g == w


def manager(daemon: Daemon, job: str, **options: Any) -> Any:
    opts = ocp.CheckpointManagerOptions(**options)
    return ckptd_orbax.CheckpointManager(
        f"/unused/{job}/checkpoints",
        options=opts,
        item_names=("state", "py", "meta"),
        socket=daemon.socket,
    )


def test_composite_round_trip_of_every_args_type(daemon: Daemon) -> None:
    mngr = manager(daemon, "rt")
    assert mngr.client.job == "rt"  # MaxText's <run_name>/checkpoints
    assert mngr.latest_step() is None and mngr.all_steps() == []
    s1, s2 = state(1), state(2)
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(s1),
        py=ocp.args.PyTreeSave(s2, save_args=jax.tree_util.tree_map(lambda _: ocp.SaveArgs(), s2)),
        meta=ocp.args.JsonSave({"lr": 0.1, "tokens": [1, 2]}),
    )
    assert mngr.save(1, args=args, custom_metadata={"scan_layers": True}, metrics={"loss": 2.5})
    mngr.wait_until_finished()
    assert SaveHandle(mngr.client, 1).state() in ("LOCAL", "DRAINING", "DURABLE")
    assert mngr.all_steps() == [1] and mngr.latest_step() == 1
    with pytest.raises(ckptd_orbax.StepAlreadyExistsError):
        mngr.save(1, args=args, force=True)

    # StandardRestore onto the saved shardings; PyTreeRestore with MaxText's restore_args
    # onto another sharding; JsonRestore.
    other = NamedSharding(mesh(), P(None, "x"))
    target = abstract(s2)
    target["params"]["w"] = jax.ShapeDtypeStruct((8, 6), np.float32)
    restore_args = jax.tree_util.tree_map(lambda x: ocp.RestoreArgs(), target)
    restore_args["params"]["w"] = ocp.type_handlers.ArrayRestoreArgs(sharding=other)
    got = mngr.restore(
        1,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract(s1)),
            py=ocp.args.PyTreeRestore(item=target, restore_args=restore_args),
            meta=ocp.args.JsonRestore(),
        ),
    )
    assert isinstance(got, ocp.args.Composite)
    assert_equal(got.state, s1)
    assert got.py["params"]["w"].sharding == other
    assert np.array_equal(np.asarray(got.py["params"]["w"]), np.asarray(s2["params"]["w"]))
    assert_equal(got.py["opt"], s2["opt"])
    assert got.meta == {"lr": 0.1, "tokens": [1, 2]}

    # Only some items (the others are not built), and restore with no args (as saved).
    only = mngr.restore(1, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    assert list(only.keys()) == ["meta"]
    saved = mngr.restore(None)
    assert sorted(saved.keys()) == ["meta", "py", "state"]
    assert np.array_equal(saved.state["params"]["w"], np.asarray(s1["params"]["w"]))

    meta = mngr.metadata(1)
    assert meta.custom_metadata == {"scan_layers": True} and meta.metrics == {"loss": 2.5}
    assert "py" in meta.item_metadata and meta.item_metadata["meta"] == {
        "lr": 0.1,
        "tokens": [1, 2],
    }
    w_meta = mngr.item_metadata(1)["state"]["params"]["w"]
    assert (w_meta.shape, w_meta.dtype) == ((8, 6), np.float32)

    # Refusals say what to do.
    with pytest.raises(InvalidArgument, match="JsonRestore"):
        mngr.restore(1, args=ocp.args.Composite(meta=ocp.args.StandardRestore()))
    with pytest.raises(InvalidArgument, match="no item 'nope'"):
        mngr.restore(1, args=ocp.args.Composite(nope=ocp.args.StandardRestore()))
    with pytest.raises(InvalidArgument, match="Composite"):
        mngr.save(2, args=ocp.args.StandardSave(s1), force=True)
    bad = abstract(s1)
    del bad["params"]["b"]
    with pytest.raises(TreeMismatch, match="'b'"):
        mngr.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(bad)))
    mngr.close()


def test_partial_restore_and_one_unnamed_item(daemon: Daemon) -> None:
    options = ocp.CheckpointManagerOptions(save_interval_steps=5)
    mngr = ckptd_orbax.CheckpointManager(job="single", socket=daemon.socket, options=options)
    s = state(3)
    assert mngr.save(0, args=ocp.args.StandardSave(s))
    assert not mngr.save(3, args=ocp.args.StandardSave(s))  # not a multiple of 5
    assert not mngr.should_save(0)  # not after the newest step
    # PyTreeRestore(partial_restore=True), as MaxText passes: entries the target lacks
    # are left out, entries the step lacks come back as the target gave them.
    target = abstract(s)
    del target["params"]["b"]
    target["params"]["lora"] = jax.ShapeDtypeStruct((2,), np.float32)
    args = ocp.args.PyTreeRestore(
        item=target,
        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True,
    )
    got = mngr.restore(0, args=args)
    assert sorted(got["params"]) == ["lora", "w"]
    assert got["params"]["lora"] is target["params"]["lora"]
    assert_equal(got["params"]["w"], s["params"]["w"])
    assert got["step"] == 3 and got["name"] == "tiny"
    mngr.close()
    # A new manager (a restarted trainer) finds the step and its mode from the daemon.
    again = ckptd_orbax.CheckpointManager(job="single", socket=daemon.socket)
    assert again.all_steps() == [0]
    assert_equal(again.restore(0, args=ocp.args.StandardRestore(abstract(s))), s)
    again.close()


# -- training loops in subprocesses (tests/frameworks/orbax_train.py) ---------------
STEPS = 12


def start(sock: Path, job: str, out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.frameworks.orbax_train", str(sock), job, str(out), *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(procs: list[subprocess.Popen[str]]) -> None:
    """Wait for the workers; fail with their output if any failed."""
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outputs.append(out)
    for p in procs:
        assert p.returncode == 0, "\n".join(o[-4000:] for o in outputs)


def kill_when_held(procs: list[subprocess.Popen[str]], out: Path) -> list[dict[str, Any]]:
    """SIGKILL the workers once each wrote OUT.held<process> (right after a save
    returned); what each wrote there (the step held at, the step it started from)."""
    held = [Path(f"{out}.held{i}") for i in range(len(procs))]
    t0 = time.monotonic()
    while not all(h.exists() for h in held):
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, dead[0].communicate()[0][-4000:]
        assert time.monotonic() - t0 < 300, "the workers never reached the held step"
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait(60)
    out_ = [json.loads(h.read_text()) for h in held]
    for h in held:
        h.unlink()
    return out_


def final(out: Path) -> tuple[dict[str, Any], list[np.ndarray]]:
    with np.load(str(out) + ".npz") as z:
        arrays = [z[f"arr_{i}"] for i in range(len(z.files))]
    return json.loads(Path(str(out) + ".json").read_text()), arrays


def assert_bit_exact(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.tobytes() == w.tobytes()


def test_training_loop_killed_after_a_save_resumes_bit_exact_and_after_node_loss(
    make_daemon: Any, tmp_path: Path
) -> None:
    bucket = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    d = remote_daemon(make_daemon, bucket)
    ref = tmp_path / "ref"
    finish([start(d.socket, "ref", ref, "--steps", str(STEPS))])
    ref_summary, want = final(ref)
    assert ref_summary["start"] is None and ref_summary["saved"] == [1, 3, 6, 9, 12]

    # SIGKILL right after save(6) returned: the daemon owns the bytes and finishes it.
    run = tmp_path / "run"
    held = kill_when_held([start(d.socket, "job", run, "--hold-at", "6")], run)
    assert held == [{"step": 6, "start": None, "process": 0}]
    client = d.client("job")
    SaveHandle(client, 6).wait("durable", 120)
    held = kill_when_held([start(d.socket, "job", run, "--hold-at", "9")], run)
    assert held == [{"step": 9, "start": 6, "process": 0}]
    SaveHandle(client, 9).wait("durable", 120)

    # The node is lost: a fresh daemon, its disk wiped, on the same bucket.
    d.stop()
    shutil.rmtree(d.root)
    d.start()
    finish([start(d.socket, "job", run, "--steps", str(STEPS))])
    summary, got = final(run)
    assert summary["start"] == 9 and summary["saved"] == [12]
    assert [e.step for e in d.events_of(pb.STEP_EVENT_FETCHED, "job")] == [9]
    assert_bit_exact(got, want)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_job(sockets: list[Path], job: str, out: Path, *extra: str) -> list[subprocess.Popen[str]]:
    """A two-process jax job (jax.distributed on 127.0.0.1, gloo): process i talks to
    ``sockets[i]``."""
    port = str(free_port())
    return [
        start(s, job, out, "--process-id", str(i), "--num-processes=2", "--port", port, *extra)
        for i, s in enumerate(sockets)
    ]


def test_two_processes_global_mesh_two_daemons_and_one_shared_daemon(
    make_daemon: Any, tmp_path: Path
) -> None:
    bucket = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    nodes = [
        remote_daemon(make_daemon, bucket, extra_args=["--node-id", f"node-{i}"]) for i in (0, 1)
    ]
    ref = tmp_path / "ref"
    finish(start_job([d.socket for d in nodes], "ref", ref))
    _, want = final(ref)

    # One daemon per node: each process hands its own shards to its node's daemon.
    run = tmp_path / "run"
    held = kill_when_held(start_job([d.socket for d in nodes], "job", run, "--hold-at", "6"), run)
    assert [h["step"] for h in held] == [6, 6]
    for d in nodes:  # each node's part: process i's shards only
        SaveHandle(d.client("job"), 6).wait("local", 120)
        (info,) = [c for c in d.client("job").list() if c.step == 6]
        assert info.num_shards > 0
    finish(start_job([d.socket for d in nodes], "job", run))
    summary, got = final(run)
    assert summary["start"] == 6 and summary["saved"] == [9, 12]
    assert_bit_exact(got, want)

    # One daemon both processes share (node_ranks found by the manager): the step is
    # LOCAL once both ranks committed to it.
    shared = nodes[0].socket
    run = tmp_path / "shared"
    held = kill_when_held(start_job([shared, shared], "shared", run, "--hold-at", "9"), run)
    assert [h["step"] for h in held] == [9, 9]
    SaveHandle(nodes[0].client("shared"), 9).wait("local", 120)
    finish(start_job([shared, shared], "shared", run))
    summary, got = final(run)
    assert summary["start"] == 9 and summary["saved"] == [12]
    assert_bit_exact(got, want)

    # Replica 0 only (as Orbax): process 1 saved none of the arrays replicated over
    # the mesh, so its daemon reads node-0's part from the bucket to restore them.
    run = tmp_path / "zero"
    sockets = [d.socket for d in nodes]
    held = kill_when_held(start_job(sockets, "zero", run, "--hold-at", "6", "--replicas-zero"), run)
    assert [h["step"] for h in held] == [6, 6]
    for d in nodes:
        SaveHandle(d.client("zero"), 6).wait("durable", 120)
    finish(start_job(sockets, "zero", run, "--replicas-zero"))
    summary, got = final(run)
    assert summary["start"] == 6
    assert_bit_exact(got, want)
    peers = nodes[1].events_of(pb.STEP_EVENT_PEERS_FETCHED, "zero")
    assert [(e.step, e.attributes["node"]) for e in peers] == [(6, "node-0")]


def test_continuous_policy_waits_for_the_previous_save_and_specific_steps(
    make_daemon: Any,
) -> None:
    d = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=pause"})
    policy = policies.ContinuousCheckpointingPolicy()
    options = ocp.CheckpointManagerOptions(save_decision_policy=policy)
    mngr = ckptd_orbax.CheckpointManager(job="cont", socket=d.socket, options=options)
    s = state(1)
    assert mngr.save(1, args=ocp.args.StandardSave(s))
    d.wait_failpoint("write.begin")  # the daemon holds step 1 before its disk
    assert mngr.is_saving_in_progress()
    assert not mngr.should_save(2) and not mngr.save(2, args=ocp.args.StandardSave(s))
    d.release("write.begin")
    mngr.wait_until_finished()
    assert not mngr.is_saving_in_progress() and mngr.should_save(3)
    assert mngr.save(3, args=ocp.args.StandardSave(s)) and mngr.all_steps() == [1, 3]
    mngr.close()

    steps = policies.SpecificStepsPolicy(steps=[4, 7])
    options = ocp.CheckpointManagerOptions(save_decision_policy=steps)
    mngr = ckptd_orbax.CheckpointManager(job="cont", socket=d.socket, options=options)
    assert mngr.all_steps() == [1, 3]  # a new manager: the daemon's steps
    assert [t for t in range(3, 9) if mngr.save(t, args=ocp.args.StandardSave(s))] == [4, 7]
    mngr.close()


def until(check: Any, rows: Any, timeout: float = 60.0) -> None:
    """Wait for the evictor (a background pass after each LOCAL) to make ``check`` true;
    fail with what ``rows()`` shows."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"retention never got there: {rows()}"
        time.sleep(0.05)


def kept(daemon: Daemon, job: str) -> list[tuple[int, tuple[str, ...], tuple[str, ...]]]:
    return [(c.step, c.tiers, c.local_reasons) for c in daemon.client(job).list()]


def test_max_to_keep_best_fn_and_keep_period_are_the_jobs_retention(daemon: Daemon) -> None:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min", keep_period=4
    )
    mngr = ckptd_orbax.CheckpointManager(job="ranked", socket=daemon.socket, options=options)
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 6.0, 6: 3.0, 7: 9.0}
    for t, loss in losses.items():
        assert mngr.save(t, args=ocp.args.StandardSave(state(t)), metrics={"loss": loss})
    mngr.wait_until_finished()
    # The two best (2, 4), every 4th (4), and the newest, which ckptd always keeps.
    # The others go; one whose unchanged shards a kept step reads stays until that
    # step goes (one just read, for a grace period), but it is no longer the job's,
    # and Orbax no longer lists it.
    until(lambda: mngr.all_steps() == [2, 4, 7], lambda: kept(daemon, "ranked"))
    for step, _, reasons in kept(daemon, "ranked"):  # the others are on their way out
        assert step in (2, 4, 7) or all(
            r == "in-use" or r.startswith("referenced-by-") for r in reasons
        ), (step, reasons)
    assert mngr.best_step() == 2 and mngr.metrics(2) == {"loss": 1.0}
    assert_equal(mngr.restore(mngr.all_steps()[0], args=ocp.args.StandardRestore(
        abstract(state(2)))), state(2))  # fmt: skip
    mngr.close()
    again = ckptd_orbax.CheckpointManager(job="ranked", socket=daemon.socket, options=options)
    assert again.all_steps() == [2, 4, 7], kept(daemon, "ranked")
    assert again.best_step() == 2  # from the daemon's record
    again.close()
    one = ocp.CheckpointManagerOptions(max_to_keep=1)
    unranked = ckptd_orbax.CheckpointManager(job="latest", socket=daemon.socket, options=one)
    for t in (1, 2, 3):
        unranked.save(t, args=ocp.args.StandardSave(state(t)))
    unranked.wait_until_finished()
    until(lambda: unranked.all_steps() == [3], lambda: kept(daemon, "latest"))
    assert unranked.best_step() == 3
    unranked.close()


def test_orbax_preservation_policies_map_to_ckptds() -> None:
    from ckptd.client.orbax.retention import Retention

    pp = policies.preservation_policy if hasattr(policies, "preservation_policy") else None
    pp = pp or __import__(
        "orbax.checkpoint._src.checkpoint_managers.preservation_policy", fromlist=["x"]
    )

    def text(**options: Any) -> str | None:
        return Retention(ocp.CheckpointManagerOptions(**options)).text

    assert text() is None  # Orbax's default keeps every step: the node's policy
    assert text(max_to_keep=3) == "KeepLatest(3)"
    assert text(max_to_keep=2, keep_period=10) == "KeepAny([KeepEverySteps(10), KeepLatest(2)])"
    policy = pp.AnyPreservationPolicy([
        pp.LatestN(n=1), pp.EveryNSteps(interval_steps=5), pp.CustomSteps(steps=[3, 1]),
        pp.BestN(get_metric_fn=lambda m: m["acc"], reverse=False, n=2),
    ])  # fmt: skip
    r = Retention(ocp.CheckpointManagerOptions(preservation_policy=policy))
    assert r.text == (
        "KeepAny([KeepLatest(1), KeepEverySteps(5), KeepSteps([1, 3]), "
        "KeepBest('orbax_best', 2, 'max', keep_without_metric=True)])"
    )
    assert r.scores({"acc": 0.5}) == {"orbax_best": 0.5} and r.scores(None) == {}
    no_limit = ocp.CheckpointManagerOptions(preservation_policy=pp.LatestN(n=None))
    assert Retention(no_limit).text is None  # MaxText's default: the node's policy
    closest = pp.EveryNStepsClosest(interval_steps=5)
    assert Retention(ocp.CheckpointManagerOptions(preservation_policy=closest)).text is None


def test_a_rollback_keeps_saving_and_every_new_save(daemon: Daemon) -> None:
    mngr = ckptd_orbax.CheckpointManager(job="roll", socket=daemon.socket)
    for t in (1, 2, 3):
        assert mngr.save(t, args=ocp.args.StandardSave(state(t)))
    mngr.wait_until_finished()
    # Back to step 1 (after a loss spike): training goes on from there, and saves.
    got = mngr.restore(1, args=ocp.args.StandardRestore(abstract(state(1))))
    assert_equal(got, state(1))
    assert mngr.all_steps() == [1] and mngr.should_save(2)
    assert mngr.save(2, args=ocp.args.StandardSave(state(20)))
    mngr.close()
    again = ckptd_orbax.CheckpointManager(job="roll", socket=daemon.socket)
    assert again.all_steps() == [1, 2]  # the new timeline: the old 2 and 3 are abandoned
    assert_equal(again.restore(None, args=ocp.args.StandardRestore(abstract(state(20)))), state(20))
    again.close()


def test_preemption_saves_waits_for_the_bucket_and_stops(make_daemon: Any, tmp_path: Path) -> None:
    bucket = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    d = remote_daemon(make_daemon, bucket)
    out = tmp_path / "pre"
    args = ["--steps", "100000", "--save-every", "1000", "--preempt-at", "3"]
    finish([start(d.socket, "pre", out, *args, "--port", str(free_port()))])
    summary = json.loads(Path(f"{out}.json").read_text())
    step = summary["preempted"]
    assert step is not None and step > 3 and summary["saved"] == [1, step]
    # wait_until_finished waited for the bucket: the step is DURABLE as the trainer exits.
    (info,) = [c for c in d.client("pre").list() if c.step == step]
    assert "REMOTE" in info.tiers, info


def test_importing_ckptd_imports_no_orbax_until_the_manager_is_named() -> None:
    code = (
        "import sys; import ckptd.client; from ckptd.client import orbax as o; "
        "before = 'orbax.checkpoint' in sys.modules or 'jax' in sys.modules; "
        "o.CheckpointManager; print(before, 'orbax.checkpoint' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "True"]
