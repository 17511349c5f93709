"""Helpers of ``bench_transformer.py``: the two states and the peer arms (DCP, Orbax).

- :func:`transformer_state`: a decoder-only transformer's training state, the
  parameters plus Adam's two moments (``{"params", "mu", "nu"}``, ~1,500 arrays
  from KiB-sized biases and norms to a vocab x d_model embedding);
- :func:`eight_array_state`: the same number of bytes in 8 equal float32 arrays;
- :class:`DcpArm`: PyTorch DCP ``save`` / ``async_save`` / ``load`` in one
  process (no process group), ``FileSystemWriter`` on the bench disk;
- :class:`OrbaxArm`: Orbax ``StandardCheckpointer`` save / restore of the numpy tree.

Each arm's ``save``/``restore`` returns its timings in seconds and checks what
it restored against the state outside the timing.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from common import drop_caches, settle
from floors import touch

Tree = dict[str, Any]

LAYERS = 31
"""Transformer blocks: 16 arrays each, plus embedding and final norm: 499 per tree."""


def leaves(tree: Tree) -> Iterator[Any]:
    """The leaves of a nested dict, depth first in insertion order."""
    for v in tree.values():
        if isinstance(v, dict):
            yield from leaves(v)
        else:
            yield v


def tree_map(fn: Any, tree: Tree) -> Tree:
    """``fn`` applied to every leaf of a nested dict (same structure)."""
    return {k: tree_map(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def param_dtype(name: str) -> np.dtype:
    """``float32`` or ``bfloat16`` (from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def transformer_shapes(total_bytes: int, pdtype: np.dtype) -> tuple[int, int, dict[str, Any]]:
    """``(d_model, vocab, shapes)`` of a params tree that, with two float32 moments,
    fills about ``total_bytes``; d_model is the largest multiple of 64 whose blocks
    take at most 80% of the parameters, the embedding takes the rest."""
    n = total_bytes // (pdtype.itemsize + 8)
    d = max(64, int((0.8 * n / (12 * LAYERS)) ** 0.5) // 64 * 64)
    per_layer = 12 * d * d + 13 * d
    vocab = max(1, (n - LAYERS * per_layer - 2 * d) // d)
    block = {
        **{f"attn_{m}_w": (d, d) for m in "qkvo"},
        **{f"attn_{m}_b": (d,) for m in "qkvo"},
        "ln1_scale": (d,),
        "ln1_bias": (d,),
        "mlp_in_w": (d, 4 * d),
        "mlp_in_b": (4 * d,),
        "mlp_out_w": (4 * d, d),
        "mlp_out_b": (d,),
        "ln2_scale": (d,),
        "ln2_bias": (d,),
    }
    shapes: dict[str, Any] = {"embed": (vocab, d)}
    shapes |= {f"layer_{i:02d}": dict(block) for i in range(LAYERS)}
    shapes |= {"final_ln_scale": (d,), "final_ln_bias": (d,)}
    return d, vocab, shapes


def transformer_state(total_bytes: int, pdtype: np.dtype, seed: int) -> tuple[Tree, dict[str, int]]:
    """``({"params", "mu", "nu"}, info)``: random values, params in ``pdtype``, moments
    float32 (``nu`` non-negative, as squares are)."""
    d, vocab, shapes = transformer_shapes(total_bytes, pdtype)
    rng = np.random.default_rng(seed)

    def make(shape: tuple[int, ...], dtype: np.dtype, positive: bool = False) -> np.ndarray:
        a = rng.standard_normal(shape, np.float32)
        if positive:
            np.abs(a, out=a)
        return a if dtype == np.float32 else a.astype(dtype)

    def build(dtype: np.dtype, positive: bool = False) -> Tree:
        return tree_map(lambda s: make(s, dtype, positive), shapes)

    state = {"params": build(pdtype), "mu": build(np.dtype(np.float32))}
    state["nu"] = build(np.dtype(np.float32), positive=True)
    return state, {"d_model": d, "vocab": vocab, "layers": LAYERS}


def eight_array_state(total_bytes: int, seed: int) -> Tree:
    """8 float32 arrays of (nearly) equal size, ``total_bytes`` together."""
    rng = np.random.default_rng(seed)
    n = total_bytes // 4
    sizes = [n // 8 + (1 if i < n % 8 else 0) for i in range(8)]
    return {f"a{i}": rng.standard_normal(s, np.float32) for i, s in enumerate(sizes)}


def numpy_of(x: Any) -> np.ndarray:
    """A numpy view of a numpy array or CPU torch tensor (bfloat16 as int16 bits)."""
    if isinstance(x, np.ndarray):
        return x
    import torch

    return (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy()


def check_equal(state: Tree, got: Any, who: str, path: str = "") -> None:
    """Raise unless ``got`` holds, key by key, the bytes of every leaf of ``state``."""
    for k, a in state.items():
        b = got[k]
        if isinstance(a, dict):
            check_equal(a, b, who, f"{path}{k}/")
            continue
        bb = numpy_of(b) if not isinstance(b, np.ndarray) else b
        bb = np.asarray(bb)
        if a.shape != bb.shape or not np.array_equal(a.view(np.uint8), bb.view(np.uint8)):
            raise AssertionError(f"{who}: {path}{k} differs from the saved state")


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` (Orbax leaves its files unsynced)."""
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class DcpArm:
    """PyTorch DCP on one process: the state as ``torch.from_numpy`` views (no copy)."""

    def __init__(self, state: Tree, run: Path, tag: str) -> None:
        import torch
        import torch.distributed.checkpoint as dcp

        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        self.torch, self.dcp, self.state = torch, dcp, state
        self.tensors = tree_map(self._tensor, state)
        # load() fills existing tensors in place (a model's state dict): allocated and
        # touched once here, as a trainer's model would be.
        self.target = tree_map(lambda t: torch.zeros_like(t), self.tensors)
        self.dir = run / f"dcp-{tag}"

    def _tensor(self, a: np.ndarray) -> Any:
        if a.dtype.name == "bfloat16":
            return self.torch.from_numpy(a.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(a)

    def save(self, rep: int) -> dict[str, float]:
        """Sync save (returns written and fsynced), then ``async_save`` to another dir."""
        sync_dir, async_dir = self.dir / f"sync-{rep}", self.dir / f"async-{rep}"
        settle()
        t0 = time.perf_counter()
        self.dcp.save(self.tensors, storage_writer=self.dcp.FileSystemWriter(sync_dir))
        t1 = time.perf_counter()
        settle()
        t2 = time.perf_counter()
        fut = self.dcp.async_save(self.tensors, storage_writer=self.dcp.FileSystemWriter(async_dir))
        t3 = time.perf_counter()
        fut.result()
        t4 = time.perf_counter()
        shutil.rmtree(async_dir)
        return {"dcp_save": t1 - t0, "dcp_async_return": t3 - t2, "dcp_async_durable": t4 - t2}

    def restore(self, rep: int) -> dict[str, float]:
        """``dcp.load`` into the touched target, cold, plus a read of every byte."""
        src = self.dir / f"sync-{rep}"
        for t in leaves(self.target):
            t.zero_()  # untimed: a failed load cannot pass the check on old bytes
        drop_caches(src)
        settle()
        t0 = time.perf_counter()
        self.dcp.load(self.target, storage_reader=self.dcp.FileSystemReader(src))
        touch([numpy_of(t) for t in leaves(self.target)])
        took = time.perf_counter() - t0
        check_equal(self.state, self.target, "DCP load")
        shutil.rmtree(src)
        return {"dcp_restore": took}


class OrbaxArm:
    """Orbax ``StandardCheckpointer`` (async) on the numpy tree."""

    def __init__(self, state: Tree, run: Path, tag: str) -> None:
        import orbax.checkpoint as ocp

        self.state, self.ckptr = state, ocp.StandardCheckpointer()
        self.dir = run / f"orbax-{tag}"
        self.dir.mkdir(parents=True, exist_ok=True)

    def save(self, rep: int) -> dict[str, float]:
        """``save`` return, ``wait_until_finished``, then an fsync of its files."""
        path = self.dir / f"step-{rep}"
        settle()
        t0 = time.perf_counter()
        self.ckptr.save(path, self.state)
        t1 = time.perf_counter()
        self.ckptr.wait_until_finished()
        t2 = time.perf_counter()
        fsync_tree(path)
        t3 = time.perf_counter()
        return {"orbax_return": t1 - t0, "orbax_finished": t2 - t0, "orbax_fsynced": t3 - t0}

    def restore(self, rep: int) -> dict[str, float]:
        """``restore(path, target=state)`` (numpy leaves), cold, plus a read of every byte."""
        path = self.dir / f"step-{rep}"
        drop_caches(path)
        settle()
        t0 = time.perf_counter()
        got = self.ckptr.restore(path, self.state)
        touch([np.asarray(a) for a in leaves(got)])
        took = time.perf_counter() - t0
        check_equal(self.state, got, "Orbax restore")
        del got
        shutil.rmtree(path)
        return {"orbax_restore": took}

    def close(self) -> None:
        """Close the checkpointer (its background threads)."""
        self.ckptr.close()
