"""`make image` and `make push`: built with whichever of docker, podman or buildah
works (docker only with its daemon answering), tagged ckptd:<version>, pushed under
REGISTRY; with no engine, or no REGISTRY to push to, one line says what to do.

No container engine is needed: the engines here are stand-ins on a PATH of their
own that record how they were called, which is all the targets decide."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
MAKE = shutil.which("make")

pytestmark = pytest.mark.skipif(MAKE is None, reason="make is not installed")


def _bin(tmp_path: Path, engines: dict[str, int]) -> Path:
    """A PATH holding only what the targets use (sh, sed) and a stand-in for each engine
    named, which logs its arguments and exits with the given status for `info`."""
    path = tmp_path / "bin"
    path.mkdir()
    for tool in ("sh", "sed"):
        found = shutil.which(tool)
        assert found is not None, tool
        (path / tool).symlink_to(found)
    for engine, info_status in engines.items():
        script = path / engine
        script.write_text(
            "#!/bin/sh\n"
            f'echo "{engine} $*" >> "{tmp_path}/calls"\n'
            f'[ "$1" = info ] && exit {info_status}\n'
            "exit 0\n"
        )
        script.chmod(0o755)
    return path


def _make(
    tmp_path: Path, path: Path, *args: str
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "CONTAINER_ENGINE"))}
    for key in ("TAG", "IMAGE", "REGISTRY"):
        env.pop(key, None)  # the Makefile's defaults, not the caller's environment
    env["PATH"] = str(path)
    out = subprocess.run(
        [str(MAKE), "--no-print-directory", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    calls = tmp_path / "calls"
    return out, calls.read_text().splitlines() if calls.exists() else []


def test_without_an_engine_make_image_says_what_to_install(tmp_path: Path) -> None:
    # docker's client alone, its daemon not answering, counts as no engine.
    out, calls = _make(tmp_path, _bin(tmp_path, {"docker": 1}), "image")
    assert out.returncode != 0
    message = out.stderr.strip().splitlines()[0]
    assert message.startswith("make image: no container engine"), out.stderr
    assert "podman" in message and "CONTAINER_ENGINE=" in message, message
    assert all(c.startswith("docker info") for c in calls), calls  # nothing was built


@pytest.mark.parametrize(
    ("engines", "build"),
    [
        ({"docker": 0, "podman": 0}, f"docker build -t ckptd:{VERSION} -f Dockerfile ."),
        ({"docker": 1, "podman": 0}, f"podman build -t ckptd:{VERSION} -f Dockerfile ."),
        ({"buildah": 0}, f"buildah bud -t ckptd:{VERSION} -f Dockerfile ."),
    ],
)
def test_make_image_builds_the_version_with_the_engine_that_works(
    tmp_path: Path, engines: dict[str, int], build: str
) -> None:
    out, calls = _make(tmp_path, _bin(tmp_path, engines), "image")
    assert out.returncode == 0, out.stderr
    assert [c for c in calls if " info" not in c] == [build]


def test_make_push_tags_and_pushes_under_the_registry(tmp_path: Path) -> None:
    path = _bin(tmp_path, {"podman": 0})
    out, calls = _make(tmp_path, path, "push")
    assert out.returncode != 0
    assert "set REGISTRY" in out.stderr and "make push REGISTRY=" in out.stderr, out.stderr
    (tmp_path / "calls").unlink()
    out, calls = _make(tmp_path, path, "push", "REGISTRY=registry.example/team", "TAG=7")
    assert out.returncode == 0, out.stderr
    assert calls == [
        "podman build -t ckptd:7 -f Dockerfile .",
        "podman tag ckptd:7 registry.example/team/ckptd:7",
        "podman push registry.example/team/ckptd:7",
    ]
