"""Building the package says nothing a newcomer must decode: no setuptools
deprecation box (the licence is an SPDX expression), and the wheel says so."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_builds_without_deprecation_warnings(tmp_path: Path) -> None:
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    out = subprocess.run(
        [*build, str(ROOT), "-w", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "deprecat" not in (out.stdout + out.stderr).lower(), out.stdout + out.stderr
    (wheel,) = tmp_path.glob("ckptd-*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        assert "License-Expression: Apache-2.0" in z.read(meta).decode()
