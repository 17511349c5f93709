"""Plain helpers importable both by tests and by trainer subprocesses they spawn."""

from __future__ import annotations

from pathlib import Path

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
