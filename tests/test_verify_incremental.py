"""``ckptd verify`` and the step check of an incremental step: its own shards at
their place in its file, each referenced shard in the file of the step holding it;
a holder not committed, a referenced range or an own shard that does not match is
reported like any other corruption, named by file and shard."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from ckptd.core import increments
from ckptd.core.manifest import MANIFEST, Manifest
from ckptd.core.verify import verify_step

from .conftest import CKPTD, Daemon
from .helpers import flip_byte, state_for
from .increment_helper import make_incremental, shard_range


def _saved(daemon: Daemon) -> Path:
    """A full step 1 of job ``inc`` saved for real, and step 2 built incremental on it."""
    daemon.client("inc").save(1, state_for(1, 2)).wait("local", 60)
    make_incremental(daemon.root, "inc", 1, 2, change="w1")
    return daemon.root / "inc"


def _verify(root: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    return subprocess.run(
        [CKPTD, "verify", "--root", str(root), "--local-only"],
        capture_output=True, text=True, timeout=300, env=clean,
    )  # fmt: skip


def test_an_intact_incremental_step_verifies(daemon: Daemon) -> None:
    job = _saved(daemon)
    m = Manifest.from_json((job / "2" / MANIFEST).read_text())
    assert m.ranks[0].incremental and m.ranks[0].size < m.ranks[0].image_bytes
    assert verify_step(job / "2", m) == []
    out = _verify(daemon.root)
    rows = [line.split() for line in out.stdout.splitlines()]
    assert out.returncode == 0, out.stdout + out.stderr
    assert ["OK", "local", "inc/2"] in rows and ["OK", "local", "inc/1"] in rows
    # The progress counts the referenced bytes read from step 1 as well.
    last = [line for line in out.stderr.splitlines() if line.startswith("verify ")][-1]
    assert "(100%)" in last, out.stderr


def test_a_corrupt_referenced_range_is_reported_for_the_step_referencing_it(
    daemon: Daemon,
) -> None:
    job = _saved(daemon)
    m = Manifest.from_json((job / "2" / MANIFEST).read_text())
    start, length = shard_range(m, "w2")
    flip_byte(job / "1" / m.ranks[0].file, start + length // 2)  # the holder's bytes
    bad = verify_step(job / "2", m)
    assert bad == [f"{m.ranks[0].file}:w2 (step 1, referenced)"], bad
    out = _verify(daemon.root)
    assert out.returncode == 1, out.stdout + out.stderr
    line = next(x for x in out.stdout.splitlines() if "inc/2" in x)
    assert "CORRUPT" in line and ":w2 (step 1, referenced)" in line, line


def test_a_missing_holder_is_reported(daemon: Daemon) -> None:
    job = _saved(daemon)
    m = Manifest.from_json((job / "2" / MANIFEST).read_text())
    shutil.move(job / "1", daemon.root / "elsewhere")  # no step 1 committed beside it
    bad = verify_step(job / "2", m)
    assert len(bad) == 1 and "step 1, holding" in bad[0] and "not committed here" in bad[0]
    out = _verify(daemon.root)
    assert out.returncode == 1, out.stdout + out.stderr
    line = next(x for x in out.stdout.splitlines() if "inc/2" in x)
    assert "CORRUPT" in line and "is not committed here" in line, line


def test_a_corrupt_own_shard_is_reported_at_its_place_in_the_file(daemon: Daemon) -> None:
    job = _saved(daemon)
    m = Manifest.from_json((job / "2" / MANIFEST).read_text())
    start, length = shard_range(m, "w1")
    r = m.ranks[0]
    assert r.runs is not None
    flip_byte(job / "2" / r.file, increments.file_offset(r.runs, start, length) + 7)
    assert verify_step(job / "2", m) == [f"{r.file}:w1"]
    assert verify_step(job / "1", Manifest.from_json((job / "1" / MANIFEST).read_text())) == []
