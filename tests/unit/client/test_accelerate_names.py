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


def test_a_folder_name_without_a_step_is_refused_before_accelerate_saves() -> None:
    saved: list[object] = []
    config = SimpleNamespace(
        automatic_checkpoint_naming=False, total_limit=None, save_on_each_node=False
    )
    acc = SimpleNamespace(
        project_configuration=config,
        is_main_process=False,  # sends no retention: no daemon needed here
        is_local_main_process=False,
        save_state=lambda *a, **k: saved.append(a),
        load_state=None,
    )
    ckptd_accelerate.use(acc, "job")
    with pytest.raises(InvalidArgument, match="must end"):
        acc.save_state("ckpt/final")
    assert saved == []
