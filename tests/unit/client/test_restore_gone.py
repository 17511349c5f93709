"""A step's rank file removed between the daemon's answer and the client's open (the
evictor took it meanwhile) is asked for again, never a raw ``FileNotFoundError``:
the retry restores it, or the caller gets ``CheckpointNotFound`` saying what
happened (tests/unit/inproc.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client import CheckpointNotFound, Client, restore_flow

from ..inproc import in_process_daemon


def _vanishing(monkeypatch: pytest.MonkeyPatch, times: int) -> list[str]:
    """The first ``times`` opens of a step's own rank file find it gone."""
    real, gone = restore_flow.open_readable, []

    def open_readable(session: Any, path: str) -> int:
        if path.endswith("rank-00000.safetensors") and len(gone) < times:
            gone.append(path)
            raise FileNotFoundError(2, "No such file or directory", path)
        return real(session, path)

    monkeypatch.setattr(restore_flow, "open_readable", open_readable)
    return gone


def test_a_rank_file_gone_after_the_answer_is_asked_for_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = {"w": np.arange(4096, dtype=np.float32)}
    with in_process_daemon(tmp_path / "root") as d, Client("gone", socket=str(d.socket)) as c:
        c.save(1, tree).wait("local", timeout=60)
        gone = _vanishing(monkeypatch, 1)
        got, _ = c.restore(step=1, shared_memory=False)
        assert len(gone) == 1 and np.array_equal(np.asarray(got["w"]), tree["w"])
        del got
        _vanishing(monkeypatch, 100)
        with pytest.raises(CheckpointNotFound, match="removed after the daemon named it"):
            c.restore(step=1, shared_memory=False)
