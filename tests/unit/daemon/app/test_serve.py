"""``serve()`` run in process (tests/unit/inproc.py): a save reaches LOCAL and
restores bit-exact, the listing and the status answer, and a stop finishes what was
acknowledged; a second daemon on the same root is refused with what to do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ckptd.client import Client
from ckptd.daemon.app.startup import StartupError

from ...inproc import in_process_daemon


def test_a_save_restores_bit_exact_from_an_in_process_daemon(tmp_path: Path) -> None:
    tree = {"w": np.arange(4096, dtype=np.float32), "b": np.full(7, 3, dtype=np.int64)}
    with in_process_daemon(tmp_path / "root") as d, Client("unit", socket=str(d.socket)) as c:
        c.save(3, tree, metadata={"epoch": 1}).wait("local", timeout=60)
        assert [s.step for s in c.list()] == [3]
        got, meta = c.restore()
        assert meta == {"epoch": 1}
        for key, value in tree.items():
            assert np.array_equal(np.asarray(got[key]), value)
    # Stopped: the step is committed in the root, found again by the next daemon.
    with in_process_daemon(tmp_path / "root") as d, Client("unit", socket=str(d.socket)) as c:
        assert [s.step for s in c.list()] == [3]


def test_a_second_daemon_on_a_root_in_use_is_refused(tmp_path: Path) -> None:
    refused = pytest.raises((StartupError, RuntimeError), match="already serving")
    with in_process_daemon(tmp_path / "root"), refused, in_process_daemon(tmp_path / "root"):
        pass
