"""ckptd.client.accelerate without a daemon: folder names as steps, and the folder
accelerate's automatic naming would load by itself."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ckptd.client import accelerate as ckptd_accelerate
from ckptd.core.errors import InvalidArgument


def test_a_folder_is_the_step_its_name_ends_with() -> None:
    assert ckptd_accelerate.step_of("runs/42/checkpoints/checkpoint_7") == 7
    assert ckptd_accelerate.step_of(Path("ckpt/step_120")) == 120
    with pytest.raises(InvalidArgument, match="must end"):
        ckptd_accelerate.step_of("ckpt/final")


def test_the_newest_folder_is_by_number_not_by_name(tmp_path: Path) -> None:
    acc = SimpleNamespace(project_dir=str(tmp_path))
    assert ckptd_accelerate._newest_folder(acc) is None  # no checkpoints folder yet
    for n in (2, 10, 9):
        (tmp_path / "checkpoints" / f"checkpoint_{n}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "notes").mkdir()
    assert ckptd_accelerate._newest_folder(acc) == str(tmp_path / "checkpoints" / "checkpoint_10")


def test_a_job_name_is_checked_before_anything_is_wrapped() -> None:
    acc = SimpleNamespace(save_state=None, load_state=None)
    with pytest.raises(InvalidArgument, match="job name"):
        ckptd_accelerate.use(acc, "a/b")
    assert acc.save_state is None
