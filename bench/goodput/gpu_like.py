"""The GPU-like trainer of bench/goodput/job.py (``--trainer gpu-like``).

On a GPU host the step runs on the accelerator: the host's CPUs, and with them the
checkpoint daemon, do not slow it down. The JAX trainer on this VM's 2 cores is
the opposite (the daemon's copy and upload steal the step's own cores), so costs
measured with it are a CPU host's. This trainer keeps what a GPU host has:

- the step: a fixed wait for the accelerator's compute (``compute_seconds``,
  ``time.sleep``: no CPU), then a real, small host-side update in place (an
  Adam-like update of a rotating 1/16 of the state, deterministic in the step
  number and the state, so its pages are dirtied as training dirties them);
- a save: the state lives in "device" numpy buffers and is copied
  (``np.copyto``) into host buffers first, the device-to-host copy a GPU save
  pays, and those are handed to the arm's save (``Client.save`` or Orbax);
- a restore: into host memory by the arm, then copied into the device buffers.

The loss is a float32 checksum of fixed elements of the parameters: a function of
the state alone, so a resumed run's losses equal an uninterrupted run's bit for
bit (bench/goodput/run.py checks them).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

CHUNKS = 16
"""Each step updates one of CHUNKS slices of the state, in turn."""
KEYS = ("params", "mu", "nu")
"""The state: parameters and Adam's two moments, float32 each."""
PROBES = 64
"""The loss sums this many fixed elements, spread over every chunk."""


class GpuLike:
    """A ``state_mib`` MiB training state on a simulated accelerator."""

    def __init__(self, state_mib: int, seed: int, compute_seconds: float) -> None:
        if state_mib < 1:
            raise ValueError(f"--state-mib must be at least 1, not {state_mib}")
        if compute_seconds < 0:
            raise ValueError(f"--compute-seconds must be >= 0, not {compute_seconds}")
        per = state_mib * 2**20 // (len(KEYS) * 4)
        self.chunk = per // CHUNKS
        n = self.chunk * CHUNKS
        self.seed = seed
        self.compute_seconds = compute_seconds
        # Device and host memory are both allocated (and touched) once at start, as
        # a GPU job allocates its pinned staging buffers: no save pays page faults.
        self.device = {k: np.zeros(n, np.float32) for k in KEYS}
        self.host = {k: np.ones(n, np.float32) for k in KEYS}
        self._g = np.empty(self.chunk, np.float32)
        self._t = np.empty(self.chunk, np.float32)
        self._probes = np.linspace(0, n - 1, PROBES).astype(np.int64)

    def init(self) -> None:
        """The step-0 state: parameters a function of the seed, moments zero."""
        p = self.device["params"]
        # Distinct values at memory speed (random normals take seconds per GiB).
        np.copyto(p, np.arange(p.size, dtype=np.float32))
        p *= np.float32(1.0 / p.size)
        p += np.float32(self.seed % 97) * np.float32(1e-3)
        self.device["mu"].fill(0)
        self.device["nu"].fill(0)

    def load(self, tree: Any) -> None:
        """Copy a restored state (host arrays) into the device buffers."""
        for k in KEYS:
            np.copyto(self.device[k], np.asarray(tree[k]).reshape(-1))

    def step(self, step: int) -> str:
        """Run step ``step + 1`` (the state holds ``step`` steps); its loss's float32
        bits in hex."""
        time.sleep(self.compute_seconds)  # the accelerator computes: the host idles
        lo = (step % CHUNKS) * self.chunk
        p, mu, nu = (self.device[k][lo : lo + self.chunk] for k in KEYS)
        g, t = self._g, self._t
        # A gradient that depends on the step and the parameters.
        np.multiply(p, np.float32(1e-2 * ((step % 7) - 3)), out=g)
        g += np.float32(1e-3)
        mu *= np.float32(0.9)
        np.multiply(g, np.float32(0.1), out=t)
        mu += t
        nu *= np.float32(0.999)
        np.multiply(g, g, out=t)
        t *= np.float32(0.001)
        nu += t
        np.sqrt(nu, out=t)
        t += np.float32(1e-8)
        np.divide(mu, t, out=t)
        t *= np.float32(1e-4)
        p -= t
        loss = np.float32(self.device["params"][self._probes].sum(dtype=np.float32))
        return f"{int(loss.view(np.uint32)):08x}"

    def to_host(self) -> dict[str, np.ndarray]:
        """The device-to-host copy of a save: the host buffers, now holding the state."""
        for k in KEYS:
            np.copyto(self.host[k], self.device[k])
        return self.host
