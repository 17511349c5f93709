"""Every RPC, fuzzed against one live daemon: client mistakes get clean statuses.

``make test`` runs a small sample (CKPTD_FUZZ_SAMPLE cases, 200 by default);
``make fuzz`` runs the full ``fuzz``-marked test (CKPTD_FUZZ_EXAMPLES, 10,000 by
default) and writes its summary to CKPTD_FUZZ_REPORT. Runs are derandomized (the
same cases every time, so a failure reproduces) unless CKPTD_FUZZ_SEED is set.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.descriptor import MethodDescriptor
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from .harness import Harness
from .strategies import case, methods

METHODS = methods()


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    """One daemon for the module's runs; its segments must be gone once it stops."""
    h = Harness(tmp_path_factory.mktemp("fuzz"))
    h.start()
    yield h
    left = h.stop()
    assert left == 0, f"{left} shared-memory segments left in /dev/shm after the daemon stopped"


def per_method(examples: int) -> int:
    """Cases per RPC: a request without fields (GetStatus) has only the few distinct
    cases its metadata gives, and hypothesis stops once it has tried them all, so the
    others share ``examples`` among themselves."""
    return math.ceil(examples / max(1, sum(1 for m in METHODS if m.input_type.fields)))


def fuzz(h: Harness, examples: int) -> None:
    """Run at least ``examples`` generated calls, the same number against each RPC."""
    for method in METHODS:
        fuzz_method(h, method, per_method(examples))


def fuzz_method(h: Harness, method: MethodDescriptor, examples: int) -> None:
    """``examples`` generated calls of one RPC (one hypothesis run per RPC keeps the
    share of each even; hypothesis would favour some of a drawn choice)."""
    seed = os.environ.get("CKPTD_FUZZ_SEED")

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=seed is None,
        database=None,
        phases=[Phase.generate],  # no shrinking: a case's effect depends on the daemon's state
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def one(data: Any) -> None:
        h.run_case(data.draw(case(h.ctx, method), label=method.name))

    if seed is not None:
        one = hypothesis_seed(int(seed))(one)
    one()


def check(h: Harness, examples: int, report: Path | None) -> None:
    """Run, then assert the per-case and end-of-run properties."""
    h.begin()
    fuzz(h, examples)
    result = h.finish(
        report, {"examples_asked": examples, "seed": os.environ.get("CKPTD_FUZZ_SEED")}
    )
    print(json.dumps({k: v for k, v in result.items() if k != "violations"}, indent=1))
    assert result["cases"] >= examples, "hypothesis ran fewer cases than asked"
    for m in METHODS:
        ran = result["per_rpc"].get(m.name, {}).get("cases", 0)
        assert ran >= (per_method(examples) if m.input_type.fields else 1), (m.name, ran)
    assert result["daemon_alive"], h.dead
    assert result["outside_root"]["ok"], result["outside_root"]
    assert result["restart"]["alive_after"] and result["restart"]["recovered"], result["restart"]
    assert not result["damage_reported"], result["damage_reported"]
    after = result["staging_after_release"]
    assert after["leases_held"] == 0 and after["in_use_bytes"] == 0, after
    assert not result["violations"], "\n\n".join(result["violations"][:10])


def test_fuzz_sample(harness: Harness) -> None:
    """A small run in the normal test suite."""
    check(harness, int(os.environ.get("CKPTD_FUZZ_SAMPLE", "200")), None)


@pytest.mark.fuzz
@pytest.mark.timeout(3600)
def test_fuzz_full(harness: Harness) -> None:
    """The full run (``make fuzz``): 10,000 cases unless CKPTD_FUZZ_EXAMPLES says otherwise."""
    report = os.environ.get("CKPTD_FUZZ_REPORT")
    check(
        harness,
        int(os.environ.get("CKPTD_FUZZ_EXAMPLES", "10000")),
        Path(report) if report else None,
    )
