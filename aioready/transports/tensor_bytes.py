"""Tensors as bytes for MPI: dtype tables and zero-copy numpy views of tensor storage.

Numpy views cost a fraction of a microsecond where mpi4py's DLPack path costs ~7 us per buffer
(docs/async.md "Tensors through mpi4py"), and a handful of torch calls per message matters at small
sizes. bfloat16 has no numpy dtype and travels through a same-size int16 view. torch is imported on
first use.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from .header import DTYPE_CODES, TensorSpec

__all__ = ["torch_module", "spec_of", "cannot_travel", "plain", "host_bytes", "from_bytes",
           "torch_dtype", "numel", "numpy_dtype"]

_TORCH: Any = None
_CODEC: dict[Any, tuple[str, Any, Any]] = {}  # torch dtype -> (wire name, numpy dtype, torch)
_BY_NAME: dict[str, tuple[Any, Any]] = {}  # wire name -> (torch dtype, numpy dtype or None)


def torch_module() -> Any:
    """torch, imported on first use and cached with the dtype tables (few calls per message)."""
    global _TORCH
    if _TORCH is None:
        import torch
        for name in DTYPE_CODES:
            dt = getattr(torch, name)
            try:
                npdt = torch.empty(0, dtype=dt).numpy().dtype
            except TypeError:  # bfloat16: no numpy dtype, bytes go through a same-size int view
                npdt = None
            _CODEC[dt] = (name, npdt, torch.int16 if npdt is None else dt)
            _BY_NAME[name] = (dt, npdt)
        _TORCH = torch
    return _TORCH


def spec_of(t: Any) -> TensorSpec:
    if t is None:
        return TensorSpec(None, ())
    torch_module()
    found = _CODEC.get(getattr(t, "dtype", None))
    if found is None:
        raise cannot_travel(f"a tensor of dtype {str(t.dtype).removeprefix('torch.')}"
                            if hasattr(t, "dtype") else f"a {type(t).__name__}")
    return TensorSpec(found[0], t.shape)  # torch.Size is a tuple


def cannot_travel(what: str) -> ConfigError:
    """The error for a stage output the wire cannot carry (found at the sender)."""
    return ConfigError(f"a stage output cannot travel between ranks: {what}",
                       expected=f"None or dense tensors of dtype {', '.join(DTYPE_CODES)}",
                       got=what, fix="convert it in the stage's forward (e.g. .to(float32), "
                       ".to_dense()), or return it from the last stage only")


def plain(t: Any) -> Any:
    """`t` with its storage holding its values in order, ready to be copied as raw bytes: a
    copy only if it is not contiguous, or is a lazy conjugate or negation (whose memory holds
    the other sign)."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t


def host_bytes(t: Any) -> np.ndarray:
    """A flat uint8 numpy view of a CPU tensor's storage (a copy only if `plain` needs one)."""
    if t.requires_grad:
        t = t.detach()
    t = plain(t)
    _, npdt, as_dt = _CODEC[t.dtype]
    if npdt is None:
        t = t.view(as_dt)
    return t.numpy().reshape(-1).view(np.uint8)  # type: ignore[no-any-return]


def from_bytes(buf: np.ndarray, name: str, shape: tuple[int, ...]) -> Any:
    """A tensor viewing `buf` (uint8, aligned) as dtype `name` and `shape`, without copying."""
    torch = torch_module()
    dt, npdt = _BY_NAME[name]
    if npdt is not None:
        return torch.from_numpy(buf.view(npdt).reshape(shape))
    return torch.from_numpy(buf.view(np.int16)).view(dt).reshape(shape)


def numpy_dtype(name: str) -> Any:
    """The numpy dtype of wire dtype `name`, or None (bfloat16 has none)."""
    torch_module()
    return _BY_NAME[name][1]


def torch_dtype(name: str) -> Any:
    torch_module()
    return _BY_NAME[name][0]


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
