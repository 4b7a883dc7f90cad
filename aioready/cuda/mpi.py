"""CUDA-aware MPI detection, device buffers for mpi4py, and pinned host staging (docs/async.md
"CUDA tensors over MPI").

mpi4py 4.1 has no query for CUDA-awareness, so `cuda_mpi_support()` asks the MPI library that
mpi4py loaded: it finds it in /proc/self/maps (mpi4py loads it RTLD_LOCAL, so `CDLL(None)` cannot
see its symbols) and calls `MPIX_Query_cuda_support` (MPICH, Open MPI); failing that it reads the
MPI 4.1 `mpi_memory_alloc_kinds` info key for a `cuda` kind. `AIOREADY_MPI_CUDA_AWARE=0|1`
overrides both. The PyPI MPICH wheel answers 0: not CUDA-aware.

mpi4py never synchronizes CUDA streams (it exports torch tensors with `__dlpack__(stream=-1)`),
so a device buffer may be handed to MPI only after its producing event completed: the CUDA
device's `run()` returns after that, and HostStager's copies are events awaited the same way.
Without CUDA-aware MPI, activations go through pinned host buffers, copied on a separate stream
so the copy overlaps the stage's next compute.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any, NamedTuple

from ..errors import ConfigError

__all__ = ["CudaMPISupport", "cuda_mpi_support", "find_libmpi", "mpi_device_buffer",
           "loaded_mpi_library", "query_cuda_aware", "StagedSend", "receive_buffer",
           "HostStager", "transfer_path"]

log = logging.getLogger("aioready.cuda")


class CudaMPISupport(NamedTuple):
    """Whether MPI takes device pointers; `aware` is None when nothing could tell."""

    aware: bool | None
    method: str
    library: str | None
    detail: str


def find_libmpi(maps: str = "/proc/self/maps") -> str | None:
    """Path of the MPI library mapped into this process (libmpi.so*, libmpich.so*), if any."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        name = os.path.basename(path)
        if name.startswith(("libmpi.so", "libmpich.so", "libmpi_ibm.so")) and os.path.exists(path):
            return path
    return None


def _query_symbol(path: str) -> int | None:
    try:
        lib = ctypes.CDLL(path)
        fn = lib.MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return int(fn())


def _memory_kinds(comm: Any) -> str | None:
    try:
        info = comm.Get_info()
        try:
            return info.Get("mpi_memory_alloc_kinds")  # type: ignore[no-any-return]
        finally:
            info.Free()
    except Exception:
        return None


_cached: CudaMPISupport | None = None


def cuda_mpi_support(comm: Any = None, *, refresh: bool = False) -> CudaMPISupport:
    """Detect once per process whether MPI is CUDA-aware; logs which path is taken."""
    global _cached
    if _cached is not None and not refresh:
        return _cached
    forced = os.environ.get("AIOREADY_MPI_CUDA_AWARE")
    if forced is not None:
        if forced not in ("0", "1"):
            raise ConfigError("AIOREADY_MPI_CUDA_AWARE", expected="0 or 1", got=repr(forced))
        result = CudaMPISupport(forced == "1", "env", None, "AIOREADY_MPI_CUDA_AWARE")
    else:
        from mpi4py import MPI
        lib = find_libmpi()
        value = _query_symbol(lib) if lib else None
        if value is not None:
            result = CudaMPISupport(bool(value), "MPIX_Query_cuda_support", lib,
                                    f"returned {value}")
        else:
            kinds = _memory_kinds(comm if comm is not None else MPI.COMM_WORLD)
            if kinds is not None:
                aware = any(k.strip().startswith("cuda") for k in kinds.split(","))
                result = CudaMPISupport(aware, "mpi_memory_alloc_kinds", lib, kinds)
            else:
                result = CudaMPISupport(None, "none", lib, "no query symbol, no memory kinds")
    _cached = result
    log.info("CUDA-aware MPI: %s (%s: %s); %s", result.aware, result.method, result.detail,
             transfer_path(result))
    return result


def transfer_path(support: CudaMPISupport) -> str:
    """'device' when device buffers go straight to MPI, else 'staged' (pinned host copies)."""
    return "device" if support.aware else "staged"


def mpi_device_buffer(t: Any) -> Any:
    """A device tensor as mpi4py takes it (DLPack); contiguous and detached, else a clear error."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        raise ConfigError("MPI needs contiguous buffers", expected="a contiguous tensor",
                          got=f"strides {tuple(t.stride())}", fix="call .contiguous() first")
    return t


class HostStager:
    """Pinned host staging for MPI without CUDA support; copies run on their own stream.

    `to_host(t, ready)` waits (on the GPU) for the producer's event, copies into a pinned buffer
    and returns it with the copy's event; `to_device(host)` copies back. Await the events with
    `wait()` (the completion engine) before handing buffers to MPI or reading them, and
    `release()` host buffers for reuse.
    """

    def __init__(self, device: Any = None, *, wake: str = "poll") -> None:
        import torch
        self._torch = torch
        self.device = torch.device(device if device is not None else "cuda")
        self.stream = torch.cuda.Stream(self.device)
        self.wake = wake
        self._source: Any = None
        self._pool: dict[tuple[Any, ...], list[Any]] = {}

    def _pinned(self, shape: Any, dtype: Any) -> Any:
        """A pinned buffer from the pool (pinning is slow: reuse, never allocate per message)."""
        free = self._pool.get((tuple(shape), dtype))
        if free:
            return free.pop()
        return self._torch.empty(shape, dtype=dtype, pin_memory=True)

    def release(self, host: Any) -> None:
        """Give a staging buffer back once MPI and the copies are done with it."""
        self._pool.setdefault((tuple(host.shape), host.dtype), []).append(host)

    def to_host(self, t: Any, ready: Any = None) -> tuple[Any, Any]:
        torch = self._torch
        host = self._pinned(t.shape, t.dtype)
        with torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return host, done

    def to_device(self, host: Any, out: Any = None) -> tuple[Any, Any]:
        torch = self._torch
        with torch.cuda.stream(self.stream):
            if out is None:
                out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            out.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    async def wait(self, event: Any) -> None:
        import asyncio

        from .events import CUDAEventSource
        loop = asyncio.get_running_loop()
        if self._source is None or self._source.loop is not loop:
            self._source = CUDAEventSource(loop, wake=self.wake)
        await self._source.add(event, self.stream.cuda_stream, device=self.device)

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None


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
