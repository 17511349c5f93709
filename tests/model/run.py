"""Running the machine: a bounded run (``make test``), a long run with a report
(``make model-check``), and the replay of one recorded sequence (the regression
tests)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import get_state_machine_test

from .checks import STATS, Stats
from .machine import DaemonMachine
from .world import Settings

Call = tuple[str, dict[str, Any]]
"""One operation of a recorded sequence: the rule's name and its arguments."""


def run(
    sequences: int, steps: int, seed: int | None, *, database: bool, shrink: bool = True
) -> None:
    """``sequences`` generated sequences of up to ``steps`` operations each; raises
    what hypothesis raises for the failures it found (each shrunk, unless not
    ``shrink``: the bounded run fails fast and leaves shrinking to the long run)."""
    config = settings(
        max_examples=sequences,
        stateful_step_count=steps + 1,  # the start, then ``steps`` operations
        deadline=None,
        derandomize=seed is None and not database,
        database=settings.get_profile("default").database if database else None,
        suppress_health_check=list(HealthCheck),
        phases=list(Phase) if shrink else [Phase.explicit, Phase.reuse, Phase.generate],
        report_multiple_bugs=True,
        print_blob=True,
    )
    STATS.steps = steps
    test = get_state_machine_test(DaemonMachine, settings=config)
    if seed is not None:
        test = hypothesis_seed(seed)(test)
    test()


def replay(start: Settings, calls: Sequence[Call]) -> None:
    """One recorded sequence, checked after each operation and fully at the end, as
    hypothesis runs it."""
    machine = DaemonMachine()
    try:
        machine.start(settings=start)
        machine.agrees()
        for name, args in calls:
            getattr(machine, name)(**args)
            machine.agrees()
    finally:
        machine.teardown()


def report(path: Path, seconds: float, found: list[str], extra: dict[str, Any]) -> dict[str, Any]:
    """The run's counts, printed and written to ``path`` (JSON)."""
    s: Stats = STATS
    out = {
        "sequences": s.sequences,
        "operations": sum(s.operations.values()),
        "operations_by_kind": dict(sorted(s.operations.items())),
        "seconds_by_kind": {k: round(v, 1) for k, v in sorted(s.seconds.items())},
        "invariants_checked": s.checks,
        "copies_read_by_tier": dict(sorted(s.copies_read.items())),
        "slowest_quiet_seconds": round(s.slowest_quiet, 1),
        "slow_quiets": s.slow_quiets,
        "sequences_passed_at_full_length": s.full_length,
        "failing_runs": s.failures,
        "failures": found,
        "first_seen": [
            {"seconds": round(t, 1), "after_sequences": n, "failure": message}
            for t, n, message in sorted(s.first_seen.values())
        ],
        "failing_sequences": s.traces,
        "seconds": round(seconds, 1),
        **extra,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return out


def knob(name: str, default: int | None) -> int | None:
    """An integer setting from the environment (unset or empty: ``default``)."""
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else default


def clock() -> float:
    """Seconds since some fixed point, for the report."""
    return time.monotonic()
