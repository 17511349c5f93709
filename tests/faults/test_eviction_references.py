"""The daemon SIGKILLed while evicting beside references (failpoint ``evict.referenced``):
the restarted evictor plans from the catalog as it is then and never deletes what a
kept step references. The incremental step is made by hand (incremental_steps.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ckptd.core import checksum
from ckptd.core.manifest import MANIFEST, Manifest

from ..conftest import Daemon
from ..test_retention_tier import settled
from ..test_tiers_references import JOB, state, three_steps_then_incremental


def _whole(daemon: Daemon, step: int) -> None:
    """Every rank file of the step's local copy is on disk with its recorded crc32c."""
    step_dir = daemon.root / JOB / str(step)
    m = Manifest.from_json((step_dir / MANIFEST).read_text())
    for r in m.ranks:
        assert checksum.value((step_dir / r.file).read_bytes()) == r.crc32c, r.file


def _restart_killed_at_the_failpoint(daemon: Daemon) -> None:
    daemon.wait_failpoint("evict.referenced")
    daemon.kill()
    daemon.env = {}
    daemon.restart()


@pytest.mark.faults
def test_killed_evicting_beside_a_referenced_step(make_daemon: Any) -> None:
    """Step 2 goes while step 3 (kept) references step 1: killed mid-eviction, the
    restarted daemon finishes it and keeps step 1 whole."""
    daemon = three_steps_then_incremental(make_daemon)
    daemon.extra_args += ["--retention-local", "KeepLatest(1)"]
    daemon.env = {"CKPTD_FAILPOINTS": "evict.referenced=pause"}
    daemon.start()
    _restart_killed_at_the_failpoint(daemon)
    client = daemon.client(JOB)
    settled(client, [1, 3], [])
    _whole(daemon, 1)
    _whole(daemon, 3)
    assert not (daemon.root / JOB / "2").exists()
    tree, _ = client.restore(step=1)
    assert np.array_equal(tree["w0"], state()["w0"])


@pytest.mark.faults
def test_killed_evicting_a_step_and_its_holder_together(make_daemon: Any) -> None:
    """A full step 4 makes step 3 and its holder 1 evictable together: killed there,
    the restarted daemon evicts both, and at no point is step 3 left without step 1."""
    daemon = three_steps_then_incremental(make_daemon)  # KeepAll: nothing goes
    daemon.start()
    daemon.client(JOB, incremental=False).save(4, state()).wait("local", 60)
    assert daemon.stop() == 0
    daemon.extra_args += ["--retention-local", "KeepLatest(1)"]
    daemon.env = {"CKPTD_FAILPOINTS": "evict.referenced=pause"}
    daemon.start()
    _restart_killed_at_the_failpoint(daemon)
    client = daemon.client(JOB)
    settled(client, [4], [])
    for step in (1, 2, 3):
        assert not (daemon.root / JOB / str(step)).exists()
