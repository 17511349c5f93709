"""Plain helpers importable both by tests and by trainer subprocesses they spawn."""

from __future__ import annotations

import numpy as np


def state_for(seed: int, mib: int) -> dict[str, np.ndarray]:
    """A deterministic float32 state of about ``mib`` MiB in four arrays."""
    rng = np.random.default_rng(seed)
    n = mib * 2**20 // 4 // 4
    return {f"w{i}": rng.standard_normal(n, dtype=np.float32) for i in range(4)}
