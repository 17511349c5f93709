"""The goodput cost measurement's arithmetic (bench/goodput/costs_calc.py) on synthetic
event lines: which steps are undisturbed, the blocking time, the effective cost (the
extra time of the steps begun before the save was LOCAL), restarts, and the costs
file's entries; and the GPU-like trainer (bench/goodput/gpu_like.py) it measures,
which must resume bit for bit through a real daemon and through Orbax. The timings
themselves are the benchmark's, not tested here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptd.proto import ckptd_pb2 as pb

from .helpers import GOODPUT_DIR, load_goodput

calc = load_goodput("costs_calc")


def events(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines()]


# One life: 1 s steps; a save of step 3 blocks 0.2 s and is LOCAL at 104.0, DURABLE
# at 106.5. Steps 4 and 5 begin before LOCAL (1.5 s and 1.2 s: 0.5 + 0.2 extra);
# step 6 begins after it, 7 (1.3 s) while the upload runs: neither is the save's
# effective cost, neither is undisturbed.
LOG = """
start 99.0
restored 0 99.5
step 1 100.0 3f800000
step 2 101.0 3f800000
step 3 102.0 3f800000
saving 3 102.0
saved 3 102.2
step 4 103.7 3f800000
step 5 104.9 3f800000
step 6 105.9 3f800000
step 7 107.2 3f800000
step 8 108.2 3f800000
step 9 109.2 3f800000
"""
REACHED = {3: (104.0, 106.5)}


def test_effective_cost_is_the_extra_time_of_the_steps_begun_before_local() -> None:
    m = calc.measure(events(LOG), REACHED)
    # Step 1 follows the restore (not timed); 2, 3, 8, 9 ran with no save in flight.
    assert m["step"] == pytest.approx([1.0, 1.0, 1.0, 1.0])
    assert m["save_blocking"] == pytest.approx([0.2])
    # Step 4: 103.7 - 102.2 = 1.5 (0.5 extra); step 5: 1.2 (0.2 extra).
    assert m["save_effective"] == pytest.approx([0.7])
    assert m["spread_steps"] == [2]
    assert m["to_local"] == pytest.approx([2.0])
    assert m["to_durable"] == pytest.approx([4.5])


def test_to_durable_counts_only_saves_started_on_an_idle_drain() -> None:
    # A second save at step 8 starts at 108.2: the first is DURABLE (106.5), so the
    # drain is idle. With the first DURABLE at 109.0 instead, the second save queued
    # behind its upload: its to_durable (110.2 - 108.2) measures the queue.
    second = "step 8 108.2 3f800000\nsaving 8 108.2\nsaved 8 108.3"
    log = LOG.replace("step 8 108.2 3f800000", second)
    idle = calc.measure(events(log), {3: (104.0, 106.5), 8: (108.6, 110.2)})
    assert idle["to_durable"] == pytest.approx([4.5, 2.0])
    queued = calc.measure(events(log), {3: (104.0, 109.0), 8: (108.6, 110.2)})
    assert queued["to_durable"] == pytest.approx([7.0])
    assert queued["to_durable_queued"] == pytest.approx([7.0, 2.0])


def test_faster_steps_do_not_cancel_slower_ones() -> None:
    # Step 5 now takes 0.8 s: clipped at 0, it does not pay back step 4's 0.5 s.
    log = LOG.replace("step 5 104.9", "step 5 104.5").replace("step 6 105.9", "step 6 105.5")
    m = calc.measure(events(log), REACHED)
    assert m["save_effective"] == pytest.approx([0.5])


def test_orbax_finalization_stands_for_local_and_durable() -> None:
    log = LOG.replace("saved 3 102.2", "saved 3 102.2\nlocal 3 103.0")
    m = calc.measure(events(log), {})
    assert m["to_local"] == pytest.approx([1.0])
    assert m["to_durable"] == pytest.approx([1.0])
    assert m["save_effective"] == pytest.approx([0.5])  # step 4 alone began before it
    assert m["spread_steps"] == [1]


def test_orbax_finalization_logged_after_the_next_save_began_counts() -> None:
    # The save of step 8 waits for step 3's finalization, logged after "saving 8".
    log = LOG.replace(
        "step 8 108.2 3f800000",
        "step 8 108.2 3f800000\nsaving 8 108.2\nlocal 3 108.4\nsaved 8 108.5",
    )
    m = calc.measure(events(log), {})
    assert m["to_local"][0] == pytest.approx(6.4)


def test_a_save_killed_before_local_is_not_a_sample() -> None:
    m = calc.measure(events(LOG), {})  # never LOCAL: in flight to the life's end
    assert m["save_blocking"] == []
    assert m["step"] == pytest.approx([1.0, 1.0])  # only the steps before it


def test_restart_is_kill_to_the_start_of_the_next_life_s_first_step() -> None:
    log = LOG + "start 110.0\nrestored 3 111.0\nstep 4 112.5 3f800000\nstep 5 113.5 3f800000\n"
    # The first step ends 3.0 s after the kill; the simulator runs that step itself,
    # so the restart is the time to its start (one undisturbed 1.0 s step less).
    assert calc.restarts(events(log), [109.5], 1.0) == pytest.approx([2.0])
    assert len(calc.lives(events(log))) == 2
    # Steps of each life only: the second life's first step is not timed.
    assert [s for s, _, _ in calc.steps_of(calc.lives(events(log))[1])] == [5]


def test_arm_costs_are_sample_lists_in_the_costs_file_format() -> None:
    m = calc.measure(events(LOG), REACHED)
    costs = calc.arm_costs(m, {"restart": [3.0, 4.0], "node_restart": []})
    assert costs["save_effective"] == {"samples": [pytest.approx(0.7)]}
    assert costs["effective_spread_steps"] == 2
    assert costs["restart"] == {"samples": [3.0, 4.0]}
    assert "node_restart" not in costs  # falls back to the file's default
    doc = {"step": {"samples": m["step"]}, "arms": {"ckptd": costs}}
    rows = calc.table(doc)
    assert rows[0][:3] == ["all", "step", "1.000"]
    assert ["ckptd", "restart", "3.500"] in [r[:3] for r in rows]


def test_no_undisturbed_step_is_a_clear_error() -> None:
    log = "start 0\nstep 1 1.0 0\nsaving 1 1.0\nsaved 1 1.1\nstep 2 2.0 0\nstep 3 3.0 0\n"
    with pytest.raises(ValueError, match="--interval-steps"):
        calc.measure(events(log), {1: (9.0, 9.0)})


def test_node_losses_are_spread_among_the_restarts() -> None:
    plan = calc.plan_of(5, 3)
    assert sorted(plan) == ["node_restart"] * 3 + ["restart"] * 5
    assert plan[0] == "restart" and plan[-1] == "restart"
    assert "node_restart" not in calc.plan_of(5, 0)


gpu_like = load_goodput("gpu_like")


def test_gpu_like_trainer_resumes_bit_exact_from_its_host_copy() -> None:
    straight = gpu_like.GpuLike(1, seed=3, compute_seconds=0.0)
    straight.init()
    losses = [straight.step(s) for s in range(40)]
    assert len(set(losses)) > 10  # the loss moves with the state

    first = gpu_like.GpuLike(1, seed=3, compute_seconds=0.0)
    first.init()
    for s in range(17):
        first.step(s)
    saved = {k: v.copy() for k, v in first.to_host().items()}
    first.step(17)  # the device moves on; the host copy does not
    assert all((first.host[k] == saved[k]).all() for k in saved)

    resumed = gpu_like.GpuLike(1, seed=3, compute_seconds=0.0)
    resumed.load(saved)
    assert [resumed.step(s) for s in range(17, 40)] == losses[17:]


def test_gpu_like_trainer_touches_a_sixteenth_of_its_state_per_step() -> None:
    model = gpu_like.GpuLike(1, seed=0, compute_seconds=0.0)
    model.init()
    before = model.device["params"].copy()
    model.step(5)
    changed = (model.device["params"] != before).nonzero()[0]
    assert changed.min() >= 5 * model.chunk and changed.max() < 6 * model.chunk
    assert len(changed) > model.chunk // 2


def test_gpu_like_trainer_rejects_a_bad_size() -> None:
    with pytest.raises(ValueError, match="--state-mib"):
        gpu_like.GpuLike(0, seed=0, compute_seconds=0.5)


def run_job(progress: Path, *args: str) -> list[list[str]]:
    """bench/goodput/job.py with the GPU-like trainer (no compute wait), to its end."""
    job = [sys.executable, str(GOODPUT_DIR / "job.py"), "--trainer", "gpu-like"]
    cmd = [*job, "--compute-seconds", "0", "--state-mib", "2", "--progress", str(progress), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return events(progress.read_text())


def losses(log: list[list[str]]) -> dict[int, str]:
    return {int(e[1]): e[3] for e in log if e[0] == "step"}


def test_gpu_like_job_resumes_bit_exact_from_ckptd(daemon: Any, tmp_path: Path) -> None:
    reference = losses(run_job(tmp_path / "noop.log", "--arm", "noop", "--max-steps", "20"))
    save = ["--arm", "ckptd-interval", "--interval-steps", "5", "--socket", str(daemon.socket)]
    first = run_job(tmp_path / "a.log", *save, "--max-steps", "12")
    assert [int(e[1]) for e in first if e[0] == "saving"] == [5, 10]
    assert [int(e[1]) for e in first if e[0] == "saved"] == [5, 10]
    daemon.wait_event(lambda e: e.kind == pb.STEP_EVENT_LOCAL and e.step == 10, job="goodput")
    second = run_job(tmp_path / "b.log", *save, "--max-steps", "20")
    assert next(e for e in second if e[0] == "restore")[:2] == ["restore", "10"]
    assert losses(second) == {s: b for s, b in reference.items() if s > 10}


def test_gpu_like_job_resumes_bit_exact_from_orbax(tmp_path: Path) -> None:
    reference = losses(run_job(tmp_path / "noop.log", "--arm", "noop", "--max-steps", "14"))
    save = ["--arm", "orbax-interval", "--interval-steps", "4", "--dir", str(tmp_path / "ckpt")]
    first = run_job(tmp_path / "a.log", *save, "--max-steps", "10")
    # Orbax's finalization of each save is logged (its to_local), after the save began.
    assert [int(e[1]) for e in first if e[0] == "local"] == [4, 8]
    second = run_job(tmp_path / "b.log", *save, "--max-steps", "14")
    assert next(e for e in second if e[0] == "restored")[1] == "8"
    assert losses(second) == {s: b for s, b in reference.items() if s > 8}


def test_the_pace_is_the_median_gap_between_save_starts_within_a_life() -> None:
    log = (
        "start 100.0\nsaving 2 101.0\nsaving 4 103.0\nsaving 6 105.5\n"
        "start 110.0\nsaving 8 111.0\nsaving 10 113.0\n"  # no gap across lives
    )
    assert calc.interval_of(events(log)) == pytest.approx(2.0)


def test_a_life_s_first_saves_are_measured_apart_from_the_later_ones() -> None:
    # Two lives of three saves each: the first two of a life warm up (slow).
    lives = []
    for life, t0 in enumerate((100.0, 200.0)):
        rows = [f"start {t0}", f"restored 0 {t0}"]
        t = t0
        for n, blocking in enumerate((0.5 + life, 0.3, 0.1), start=1):
            step = 4 * n
            rows += [f"step {step - 1} {t + 1} 0", f"step {step} {t + 2} 0"]
            rows += [f"saving {step} {t + 2}", f"saved {step} {t + 2 + blocking}"]
            t += 4
        rows += [f"step 99 {t + 1} 0", f"step 100 {t + 2} 0"]
        lives += rows
    log = "\n".join(lives) + "\n"
    reached = {4 * n: (None, None) for n in (1, 2, 3)}
    m = calc.measure(events(log), {k: (1e9, None) for k in reached})
    assert m["save_index"] == [1, 2, 3, 1, 2, 3]
    costs = calc.arm_costs(m, {})
    assert costs["save_blocking"]["samples"] == pytest.approx([0.1, 0.1])
    first, second = costs["first_saves"]
    assert first["save_blocking"]["samples"] == pytest.approx([0.5, 1.5])
    assert second["save_blocking"]["samples"] == pytest.approx([0.3, 0.3])
    # lives too short to have later saves: every save in the section, no first_saves
    m["save_index"] = [1, 2, 1, 2, 1, 2]
    assert "first_saves" not in calc.arm_costs(m, {})
    assert len(calc.arm_costs(m, {})["save_blocking"]["samples"]) == 6
