"""The goodput benchmark's arithmetic (bench/goodput/report.py): a restart broken
down from the job's event lines, and the memory tier's arms in the table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

REPORT = Path(__file__).resolve().parents[1] / "bench" / "goodput" / "report.py"


def load_report() -> ModuleType:
    """bench/goodput/report.py as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("goodput_report", REPORT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def events(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines()]


# Three lives: the first from scratch, then a restart from memory and one from disk,
# and one killed before it restored (no restore of its own).
RUN = """
start 100.0
restored 0 101.0
step 1 102.0 aa
step 2 103.0 bb
saved 2 103.1
start 110.0
restored 2 112.0
restore 2 111.0 111.5 memory
step 3 115.0 cc
start 120.0
start 130.0
restored 2 133.0
restore 2 131.0 132.5 disk
step 3 136.0 cc
step 4 137.0 dd
"""


def test_a_restart_is_broken_down_into_its_restore_call_and_tier() -> None:
    report = load_report()
    ref = {1: "aa", 2: "bb", 3: "cc", 4: "dd"}
    row = report.summarize(events(RUN), 40.0, 1.0, 1.0, ref)
    # The life killed before it restored is no restart of its own.
    assert [r["tier"] for r in row["restarts"]] == ["memory", "disk"]
    assert [r["restore_call_s"] for r in row["restarts"]] == [0.5, 1.5]
    assert [r["restored_s"] for r in row["restarts"]] == [2.0, 3.0]
    assert [r["first_step_s"] for r in row["restarts"]] == [5.0, 6.0]
    assert (row["restores_from_memory"], row["restores_from_disk"]) == (1, 1)
    assert row["restore_call_s_p50"] == 1.0
    assert row["bit_exact"]


def test_the_table_shows_both_tiers_side_by_side() -> None:
    report = load_report()
    ref = {1: "aa", 2: "bb", 3: "cc", 4: "dd"}
    cells: list[dict[str, Any]] = []
    for arm in ("ckptd-learned", "ckptd-learned-nomem"):
        cell = report.summarize(events(RUN), 40.0, 1.0, 1.0, ref)
        cell.update(arm=arm, mtbf_s=20.0, noop_step_s=1.0)
        cells.append(cell)

    args = SimpleNamespace(mtbf=[20.0], arms=["ckptd-learned", "ckptd-learned-nomem"])
    summary = report.summarize_cells(cells, args)
    rows = [report.row_of(s) for s in summary]
    assert all(len(r) == len(report.HEADERS) for r in rows)
    column = dict(zip(report.HEADERS, rows[1], strict=True))
    assert column["arm"] == "ckptd-learned-nomem"
    assert column["restore call P50/P90 s"] == "1.00/1.40"
    assert column["memory/disk"] == "1/1"


def test_a_restart_with_no_checkpoint_yet_has_no_restore_to_break_down() -> None:
    report = load_report()
    fresh = events("""
        start 100.0
        restored 0 101.0
        step 1 102.0 aa
        start 110.0
        restored 0 111.0
        step 1 114.0 aa
    """)
    row = report.summarize(fresh, 40.0, 1.0, 1.0, {1: "aa"})
    assert row["restore_s_p50"] == 1.0  # the restart itself still counts
    assert row["restarts"][0]["tier"] is None
    assert row["first_step_s_p50"] is None
    assert (row["restores_from_memory"], row["restores_from_disk"]) == (0, 0)
