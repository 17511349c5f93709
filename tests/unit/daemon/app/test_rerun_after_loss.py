"""A rerun under a reused job name on a node that lost its disk, saving before it
ever lists or restores (a bare client starting from scratch): its first save
learns what the bucket holds of the job before its timeline is chosen, so it
begins a new timeline, the older run's steps are listed abandoned, and a restore
returns the rerun's bytes (tests/unit/inproc.py, a ``file://`` bucket)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ckptd.client import Client

from ...inproc import in_process_daemon


def _tree(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(1024, value, dtype=np.float32)}


def test_a_rerun_saving_first_after_a_node_loss_begins_a_new_timeline(tmp_path: Path) -> None:
    keys = {"remote": f"file://{tmp_path}/bucket", "node_id": "node-a"}
    with (
        in_process_daemon(tmp_path / "root-1", **keys) as d,
        Client("job", socket=str(d.socket)) as run_a,
    ):
        for step in (0, 1, 2):
            run_a.save(step, _tree(step + 1.0)).wait("durable", timeout=60)
    # The node is lost: a new daemon under the same name, its disk new.
    with (
        in_process_daemon(tmp_path / "root-2", **keys) as d,
        Client("job", socket=str(d.socket)) as run_b,
    ):
        run_b.save(0, _tree(-1.0)).wait("durable", timeout=60)
        rows = {r.step: r for r in run_b.list()}
        assert sorted(rows) == [0, 1, 2]
        assert not rows[0].abandoned and rows[1].abandoned and rows[2].abandoned
        got, _ = run_b.restore()
        assert np.array_equal(np.asarray(got["w"]), _tree(-1.0)["w"])
