"""torch tensors <-> numpy arrays as ckptd stores them, without copying the data.

A CPU tensor becomes a numpy view of its memory (strides kept: the copy into
the lease handles non-contiguous views, so nothing is made contiguous first).
Dtypes numpy knows map to themselves; bfloat16 and the float8 variants map to
their ml_dtypes types, so the manifest names the true dtype and other tools
read them; any other dtype (complex32, float4_e2m1fn_x2, bits*, uint1-7) is
stored as the unsigned integer of the same item size and its torch name is
kept beside it, so it comes back as the same torch dtype.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import torch

from ckptd.core.errors import InvalidArgument

from .device import DeviceTensor

# Same-size unsigned integer dtypes: torch can view any dtype as one of these.
_UINT = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}

_NATIVE: dict[torch.dtype, np.dtype] = {
    torch.float64: np.dtype(np.float64),
    torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16),
    torch.complex128: np.dtype(np.complex128),
    torch.complex64: np.dtype(np.complex64),
    torch.int64: np.dtype(np.int64),
    torch.int32: np.dtype(np.int32),
    torch.int16: np.dtype(np.int16),
    torch.int8: np.dtype(np.int8),
    torch.uint64: np.dtype(np.uint64),
    torch.uint32: np.dtype(np.uint32),
    torch.uint16: np.dtype(np.uint16),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}


def _ml_dtypes() -> dict[torch.dtype, np.dtype]:
    """torch dtypes whose ml_dtypes twin has the same bits (only those both sides have)."""
    out = {torch.bfloat16: np.dtype(ml_dtypes.bfloat16)}
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        tdt, ndt = getattr(torch, name, None), getattr(ml_dtypes, name, None)
        if tdt is not None and ndt is not None:
            out[tdt] = np.dtype(ndt)
    # float8_e8m0fnu: ml_dtypes and torch agree on the bits (exponent only, NaN 0xff).
    if hasattr(torch, "float8_e8m0fnu") and hasattr(ml_dtypes, "float8_e8m0fnu"):
        out[torch.float8_e8m0fnu] = np.dtype(ml_dtypes.float8_e8m0fnu)
    return out


_ML = _ml_dtypes()

_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types whose CPU instances :func:`to_array` views without further checks
(subclasses such as DTensor or fake tensors take the general path)."""


def to_array(t: torch.Tensor, keep_device: bool = False) -> tuple[Any, str]:
    """A numpy view of CPU tensor ``t`` and the torch dtype name to record ("" when
    the numpy dtype says it all). A tensor on another device is copied to the CPU,
    except, with ``keep_device``, a CUDA tensor: it becomes a :class:`DeviceTensor`,
    whose bytes a save copies from the device straight into its lease."""
    if (
        type(t) in _PLAIN
        and t.dtype in _NATIVE
        and t.is_cpu
        and t.layout is torch.strided
        and not (t.is_conj() or t.is_neg())
    ):
        # The common leaf first (a transformer's state is thousands of them): a plain
        # CPU tensor of a dtype numpy has, seen by the fewest checks (the general
        # path below took 3 us a tensor, a tenth of a save's time beyond its copy).
        return (t.detach() if t.requires_grad else t).numpy(), ""
    if type(t).__name__ == "DTensor":
        raise InvalidArgument(
            "a DTensor is one shard of a distributed tensor: save sharded (FSDP, "
            "tensor-parallel) state with torch.distributed.checkpoint and "
            "ckptd.client.torch.CkptdWriter, which records how the shards fit together"
        )
    t = t.detach()
    if t.is_sparse or t.layout != torch.strided:
        raise InvalidArgument(f"a {t.layout} tensor cannot be checkpointed; make it dense")
    if t.is_quantized:
        raise InvalidArgument(f"quantized tensors ({t.dtype}) cannot be checkpointed by ckptd")
    if t.is_conj():
        t = t.resolve_conj()  # a lazily conjugated view: its memory holds the unconjugated value
    if t.is_neg():
        t = t.resolve_neg()
    raw, dtype, torch_dtype = _as_saved(t)
    if keep_device and t.device.type == "cuda":
        # Copied as torch sees it (the copy is bytes for bytes; bfloat16 and the
        # float8s as themselves), viewed as an integer only where torch's name is kept.
        copied = raw if torch_dtype else t
        return DeviceTensor(copied, dtype, tuple(int(d) for d in t.shape)), torch_dtype
    if raw.device.type != "cpu":
        # The one extra copy of the non-CPU path: the lease is host memory.
        raw = raw.cpu()
    arr = raw.numpy()
    return (arr if arr.dtype == dtype else arr.view(dtype)), torch_dtype


def _as_saved(t: torch.Tensor) -> tuple[torch.Tensor, np.dtype, str]:
    """``t`` as tensor whose bytes are saved, the numpy dtype recorded for them and the
    torch dtype name ("" when the numpy dtype says it all): ``t`` itself for a dtype
    numpy has, else ``t`` viewed as the unsigned integer of its item size (a view for
    any strides), recorded as its ml_dtypes twin where there is one."""
    native = _NATIVE.get(t.dtype)
    if native is not None:
        return t, native, ""
    uint = _UINT.get(t.element_size())
    if uint is None:
        raise InvalidArgument(f"tensors of dtype {t.dtype} cannot be checkpointed by ckptd")
    ml = _ML.get(t.dtype)
    if ml is not None:
        return t.view(uint), ml, ""
    return t.view(uint), _NATIVE[uint], str(t.dtype).removeprefix("torch.")


def to_tensor(arr: np.ndarray, torch_dtype: str = "") -> torch.Tensor:
    """A tensor sharing ``arr``'s memory; ``torch_dtype`` as :func:`to_array` recorded it.

    ckptd aligns each array to numpy's alignment of its dtype (8 for complex128),
    but torch's vectorised kernels load whole items and crash (SIGSEGV) on a
    complex128 that is not 16-byte aligned: such an array is copied first.
    """
    if arr.size and arr.ctypes.data % min(arr.dtype.itemsize, 16):
        arr = arr.copy()  # numpy allocates with 16-byte alignment
    if torch_dtype:
        dt = getattr(torch, torch_dtype, None)
        if not isinstance(dt, torch.dtype):
            raise InvalidArgument(f"the checkpoint names torch dtype {torch_dtype!r}, unknown here")
        return torch.from_numpy(arr).view(dt)
    if arr.dtype.type.__module__.startswith("ml_dtypes"):
        tdt = next((k for k, v in _ML.items() if v == arr.dtype), None)
        if tdt is None:
            raise InvalidArgument(f"dtype {arr.dtype} has no torch equivalent here")
        return torch.from_numpy(arr.view(f"u{arr.dtype.itemsize}")).view(tdt)
    return torch.from_numpy(arr)


def load_into(target: torch.Tensor, arr: np.ndarray, torch_dtype: str = "") -> torch.Tensor:
    """Copy restored ``arr`` (of ``target``'s shape) into ``target`` in place (a
    parameter, an optimizer moment, on any device; cast to its dtype); returns it."""
    with torch.no_grad():
        source = to_tensor(arr, torch_dtype)
        if target.is_cuda:
            from .torch_device import restore_into  # (only where CUDA is)

            if restore_into(target, source):
                return target
        target.copy_(source)
    return target


def dtype_names() -> list[str]:
    """Every torch dtype this module stores that DCP's planner can size (the tests walk
    them; ``bits8``/``bits16`` are stored too, but DCP's planner rejects them)."""
    names = [str(d).removeprefix("torch.") for d in (*_NATIVE, *_ML)]
    for extra in ("complex32", "float4_e2m1fn_x2"):
        if hasattr(torch, extra):
            names.append(extra)
    return names
