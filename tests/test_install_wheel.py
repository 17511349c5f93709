"""Installing from a clone or a built wheel, as the install instructions say: the wheel
holds every file under src/ckptd (the proto's .pyi, each package's py.typed) and the
``ckptd`` console script and fsspec entry point, and installed alone into a fresh
environment (its dependencies taken from the test environment, nothing fetched) it
runs ``ckptd --version`` and imports ``ckptd.client`` from outside the clone."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"

# What a clone holds that a build must not see: this checkout's own build outputs and
# environments (a stale build/ would put old files into the wheel).
_NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
)


def _run(cmd: list[str], cwd: Path) -> str:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{' '.join(cmd)}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    return out.stdout


def _build_wheel(tmp_path: Path) -> Path:
    """`make wheel` on a copy of the clone: ``pip wheel --no-deps`` without build
    isolation, so setuptools comes from this environment rather than an index."""
    clone = tmp_path / "clone"
    shutil.copytree(REPO, clone, ignore=_NOT_COPIED)
    # This environment stands for the clone's .venv: a stamp newer than pyproject.toml
    # tells make it is set up (the target would otherwise build one).
    stamp = tmp_path / "venv-ready"
    stamp.touch()
    dist = tmp_path / "dist"
    make = shutil.which("make")
    assert make is not None, "make is not installed"
    _run([make, "wheel", f"PY={sys.executable}", f"STAMP={stamp}", f"DIST={dist}"], clone)
    (wheel,) = dist.glob("ckptd-*.whl")
    return wheel


def _source_files() -> set[str]:
    """Every file a package under src/ckptd ships: modules, stubs, markers."""
    return {
        p.relative_to(SRC).as_posix()
        for p in (SRC / "ckptd").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def test_the_wheel_installs_alone_and_runs_outside_the_clone(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
    missing = sorted(_source_files() - names)
    assert not missing, f"the wheel lacks files under src/: {missing}"
    assert {"ckptd/proto/ckptd_pb2.pyi", "ckptd/proto/py.typed", "ckptd/py.typed"} <= names
    points = configparser.ConfigParser()
    points.read_string(entry_points)
    assert points["console_scripts"]["ckptd"] == "ckptd.daemon.app.cli:main"
    assert points["fsspec.specs"]["ckptd"] == "ckptd.client.lightning.fs.CkptdFileSystem"

    # A fresh environment that sees this one's dependencies but not its ckptd: a plain
    # path line in a .pth adds the directory without running its .pth files, so the
    # editable install's path to this clone's src/ is never added.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(_run([str(python), "-c", purelib], tmp_path).strip())
    (site / "zz-test-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)], tmp_path)

    outside = tmp_path / "elsewhere"  # not the clone: its src/ is not on the path
    outside.mkdir()
    version = _run([str(venv / "bin" / "ckptd"), "--version"], outside)
    assert version.strip() == f"ckptd {wheel.name.split('-')[1]}"
    code = (
        "import importlib.metadata as md, ckptd.client, ckptd.proto.ckptd_pb2\n"
        "print(ckptd.client.__file__)\n"
        "print([e.value for e in md.entry_points(group='fsspec.specs', name='ckptd')])\n"
    )
    where, points_seen = _run([str(python), "-c", code], outside).splitlines()
    assert Path(where).is_relative_to(site), f"ckptd.client came from {where}, not the wheel"
    assert "ckptd.client.lightning.fs.CkptdFileSystem" in points_seen
