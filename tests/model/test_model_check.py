"""The model checker (tests/model/): generated operation sequences against a real
daemon and bucket, and the shrunk sequences it found, replayed as regression tests.

``make test`` runs a bounded, derandomized run (the same few sequences every time);
``make model-check`` runs the ``model``-marked long run: CKPTD_MODEL_SEQUENCES
sequences of up to CKPTD_MODEL_STEPS operations, CKPTD_MODEL_SEED for other ones,
its counts in CKPTD_MODEL_REPORT (bench/results/model-check.json).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .checks import STATS
from .run import clock, knob, report, run
from .world import Resources

BOUNDED_SEQUENCES = 4
BOUNDED_STEPS = 12
KNOBS = ("CKPTD_MODEL_SEQUENCES", "CKPTD_MODEL_STEPS", "CKPTD_MODEL_SEED", "CKPTD_MODEL_REPORT")


@pytest.mark.timeout(600)
def test_bounded_run(resources: Resources) -> None:
    """A few sequences, the same ones every run; a failure is reported as found (run
    ``make model-check`` to shrink it)."""
    run(BOUNDED_SEQUENCES, BOUNDED_STEPS, None, database=False, shrink=False)


@pytest.mark.model
@pytest.mark.timeout(0)
def test_long_run(resources: Resources, monkeypatch: pytest.MonkeyPatch) -> None:
    """The long run; its counts go to CKPTD_MODEL_REPORT whatever it finds."""
    sequences = knob("CKPTD_MODEL_SEQUENCES", 1000) or 1000
    steps = knob("CKPTD_MODEL_STEPS", 20) or 20
    seed = knob("CKPTD_MODEL_SEED", None)
    path = Path(os.environ.get("CKPTD_MODEL_REPORT", "bench/results/model-check.json"))
    for name in KNOBS:  # the daemons refuse CKPTD_ variables that are not their settings
        monkeypatch.delenv(name, raising=False)
    STATS.__init__()  # type: ignore[misc]
    began = clock()
    found: list[str] = []
    try:
        run(sequences, steps, seed, database=True)
    except BaseException as exc:
        found = [f"{type(e).__name__}: {str(e).splitlines()[0]}" for e in _each(exc)]
        raise
    finally:
        report(
            path,
            clock() - began,
            found,
            {"sequences_asked": sequences, "steps_per_sequence": steps, "seed": seed},
        )


def _each(exc: BaseException) -> list[BaseException]:
    """The failures hypothesis raised (several distinct ones come as a group)."""
    if isinstance(exc, BaseExceptionGroup):
        return [e for sub in exc.exceptions for e in _each(sub)]
    return [exc]
