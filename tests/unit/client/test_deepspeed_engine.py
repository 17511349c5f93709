"""ckptd.client.deepspeed without a daemon: tags as steps, file names inside the tag's
folder, and what a reference file is to ``torch.load`` (the daemon side is in
tests/frameworks/test_deepspeed.py)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("deepspeed")

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from ckptd.client import deepspeed as ckptd_deepspeed
from ckptd.core.errors import InvalidArgument


def test_a_tag_is_the_step_it_ends_with() -> None:
    assert ckptd_deepspeed.step_of_tag("global_step100") == 100
    assert ckptd_deepspeed.step_of_tag("step7") == 7
    with pytest.raises(InvalidArgument, match="must end"):
        ckptd_deepspeed.step_of_tag("best")


def test_create_refuses_a_tag_without_a_step_before_any_file(tmp_path: Path) -> None:
    engine = ckptd_deepspeed.CkptdCheckpointEngine("job", socket=tmp_path / "none.sock")
    with pytest.raises(InvalidArgument, match="tag=f'step"):
        engine.create(CheckpointCommitInfo("final", str(tmp_path), True))
    with pytest.raises(InvalidArgument, match="before create"):
        engine.save({}, str(tmp_path / "x.pt"))


def test_files_are_named_inside_the_tags_folder(tmp_path: Path) -> None:
    engine = ckptd_deepspeed.CkptdCheckpointEngine("job", socket=tmp_path / "none.sock")
    engine.create(CheckpointCommitInfo("global_step4", str(tmp_path), True))
    engine.save({"a": 1}, str(tmp_path / "global_step4" / "mp_rank_00_model_states.pt"))
    with pytest.raises(InvalidArgument, match="not inside"):
        engine.save({"a": 1}, str(tmp_path / "elsewhere.pt"))
    assert not engine.preserves_storage_sharing()  # no clone before the copy


def test_a_reference_unpickles_through_the_engine_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torch.load`` of a reference calls :func:`resolve`, which reads through the
    engine loading in this thread (a client of the node's daemon otherwise)."""
    seen: list[Any] = []
    engine = ckptd_deepspeed.CkptdCheckpointEngine("job", socket=tmp_path / "none.sock")

    def read(step: int, rank: int, index: int, name: str, where: Any) -> dict[str, Any]:
        seen.append((step, rank, index, name, where))
        return {"w": torch.ones(2)}

    monkeypatch.setattr(engine, "read", read)
    path = tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    ckptd_deepspeed.Reference("job", 8, 1, 0, path.name).write(path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left
    got = engine.load(str(path), map_location="cpu")
    assert torch.equal(got["w"], torch.ones(2))
    assert seen == [(8, 1, 0, path.name, "cpu")]
    with pytest.raises(pickle.UnpicklingError, match=r"ckptd\.client\.deepspeed\.resolve"):
        torch.load(path, weights_only=True)  # torch's safe load names what it refused


def test_a_plain_torch_file_loads_too(tmp_path: Path) -> None:
    """A run moving to ckptd: DeepSpeed's own files load through the engine."""
    engine = ckptd_deepspeed.CkptdCheckpointEngine("job", socket=tmp_path / "none.sock")
    torch.save({"module": {"w": torch.arange(3)}}, tmp_path / "plain.pt")
    assert torch.equal(engine.load(str(tmp_path / "plain.pt"))["module"]["w"], torch.arange(3))
