"""CUDA tensors over MPI: detect a CUDA-aware library, else stage through pinned host memory.

mpi4py 4.1 does not expose `MPIX_Query_cuda_support`, and loads libmpi RTLD_LOCAL, so the symbol
is looked up in the library file that /proc/self/maps shows loaded (ASYNC.md 4). The PyPI MPICH
wheel answers 0. `AIOREADY_MPI_CUDA_AWARE=0|1` overrides the answer (a site MPI that lacks the
symbol but is CUDA-aware, or forcing the staged path for a comparison).

mpi4py does no stream synchronisation for device buffers, so a CUDA payload is sent only after an
event recorded behind the kernel that produced it has completed; the completion engine polls it.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

__all__ = ["loaded_mpi_library", "query_cuda_aware", "StagedSend", "receive_buffer"]

log = logging.getLogger("aioready.transports.mpi")


def loaded_mpi_library() -> str | None:
    """Path of the libmpi this process has mapped (after mpi4py.MPI was imported), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                name = os.path.basename(path)
                if name.startswith(("libmpi.so", "libmpi_mpifh", "libmpich.so")) or \
                        (name.startswith("libmpi") and ".so" in name and "cxx" not in name):
                    return path
    except OSError:
        return None
    return None


def query_cuda_aware() -> tuple[bool, str]:
    """(CUDA-aware?, how we know): env override, else MPIX_Query_cuda_support(), else False."""
    forced = os.environ.get("AIOREADY_MPI_CUDA_AWARE")
    if forced in ("0", "1"):
        return forced == "1", "AIOREADY_MPI_CUDA_AWARE"
    path = loaded_mpi_library()
    if path is None:
        return False, "libmpi not found in /proc/self/maps"
    try:
        lib = ctypes.CDLL(path)
        fn = lib.MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False, f"{os.path.basename(path)} has no MPIX_Query_cuda_support"
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return bool(fn()), f"MPIX_Query_cuda_support() in {os.path.basename(path)}"


class StagedSend:
    """A CUDA payload waiting for its producer: host copy (or the device tensor) plus an event.

    `ready()` polls the event; until then the payload must not be handed to MPI.
    """

    __slots__ = ("buffer", "event")

    def __init__(self, tensor: Any, *, cuda_aware: bool) -> None:
        import torch
        if cuda_aware:
            self.buffer = tensor
        else:
            self.buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.buffer.copy_(tensor, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def ready(self) -> bool:
        return bool(self.event.query())


def receive_buffer(shape: tuple[int, ...], dtype: Any, device: Any, cuda_aware: bool) -> Any:
    """Where a payload lands: the device itself when MPI is CUDA-aware, else pinned host memory."""
    import torch
    if device is not None and torch.device(device).type == "cuda":
        if cuda_aware:
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    return torch.empty(shape, dtype=dtype)
