"""Plain helpers importable both by tests and by trainer subprocesses they spawn."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np


def flip_byte(path: Path, where: int = -3) -> None:
    """Corrupt one bit of a file in place (silent bit rot)."""
    raw = bytearray(path.read_bytes())
    raw[where] ^= 0x40
    path.write_bytes(bytes(raw))


def state_for(seed: int, mib: int) -> dict[str, np.ndarray]:
    """A deterministic float32 state of about ``mib`` MiB in four arrays."""
    rng = np.random.default_rng(seed)
    n = mib * 2**20 // 4 // 4
    return {f"w{i}": rng.standard_normal(n, dtype=np.float32) for i in range(4)}


@contextlib.contextmanager
def own_tmpfs(path: Path, size: str, mode: str = "") -> Iterator[Path]:
    """A tmpfs of the test's own mounted at ``path`` (made here; ``size`` as mount
    takes it, "64m"), so its free space is known and nothing else on the machine
    writes there. Skips the test where it cannot be mounted (it needs root);
    unmounted on exit, lazily if something still holds it."""
    import pytest  # only the tests that mount one need it, never a trainer subprocess

    path.mkdir()
    options = f"size={size}" + (f",mode={mode}" if mode else "")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False)


GOODPUT_DIR = Path(__file__).resolve().parents[1] / "bench" / "goodput"


def load_goodput(name: str) -> ModuleType:
    """A bench/goodput script as a module (bench/ is scripts, not a package; its
    scripts import each other and bench/common.py by name)."""
    for extra in (GOODPUT_DIR, GOODPUT_DIR.parent):
        if str(extra) not in sys.path:
            sys.path.insert(0, str(extra))
    spec = importlib.util.spec_from_file_location(name, GOODPUT_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def reservations_done(client: Any, timeout: float = 60) -> None:
    """Wait until ``client``'s reservations ahead of its next saves are done (white-box:
    its lease thread runs them). They hold leases until mapped, and are gRPC calls: a
    fork while one is in flight leaves the child's gRPC unusable."""
    client._saver.ahead.executor.submit(lambda: None).result(timeout=timeout)


def setpriv(user: str, group: str | None = None) -> list[str]:
    """The command prefix that runs a command as ``user`` (with ``group``: as its one
    group, else keeping this process's groups, as ``Popen(user=...)`` does).

    setpriv switches after the exec: with ``user=`` Popen forks rather than vforks,
    which runs gRPC's fork handlers in this gRPC-using process, and those can
    deadlock against gRPC's own timer thread (a test run hung in one)."""
    if group is None:
        return ["setpriv", f"--reuid={user}", "--keep-groups", "--"]
    return ["setpriv", f"--reuid={user}", f"--regid={group}", f"--groups={group}", "--"]
