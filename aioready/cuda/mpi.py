"""CUDA tensors over MPI: detecting a CUDA-aware MPI, else staging through pooled pinned memory.

mpi4py 4.1 has no query for CUDA-awareness, so `cuda_mpi_support()` asks the MPI library that
mpi4py loaded: it finds it in /proc/self/maps (mpi4py loads it RTLD_LOCAL, so `CDLL(None)` cannot
see its symbols) and calls `MPIX_Query_cuda_support` (MPICH, Open MPI); failing that it reads the
MPI 4.1 `mpi_memory_alloc_kinds` info key for a `cuda` kind. `AIOREADY_MPI_CUDA_AWARE=0|1`
overrides both (any other value is a ConfigError). The PyPI MPICH wheel answers 0: not CUDA-aware.

mpi4py never synchronizes CUDA streams (it exports torch tensors with `__dlpack__(stream=-1)`),
so a device buffer may be handed to MPI only after the work that produced it completed. Without
CUDA-aware MPI, tensors go through pinned host buffers copied on a stream of their own, so the
copies overlap the stage's compute (docs/async.md). Pinning costs far more than the copy (bench:
59 ms to pin 64 MiB, 1.3 ms to copy it), so pinned buffers come from a pool and go back to it
once MPI and the copies are done with them. Every copy ends in an event awaited through the
completion engine (events.CUDAEventSource), never in a blocking synchronize.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import math
import os
from typing import Any, Callable, Hashable, NamedTuple

from ..errors import ConfigError, InternalError
from .events import CUDAEventSource

__all__ = ["CudaMPISupport", "cuda_mpi_support", "find_libmpi", "transfer_path",
           "mpi_device_buffer", "forced_cuda_aware", "PinnedPool", "HostStager", "ENV_CUDA_AWARE"]

ENV_CUDA_AWARE = "AIOREADY_MPI_CUDA_AWARE"

log = logging.getLogger("aioready.cuda")


class CudaMPISupport(NamedTuple):
    """Whether MPI takes device pointers; `aware` is None when nothing could tell."""

    aware: bool | None
    method: str
    library: str | None
    detail: str


_LIBMPI = ("libmpi.so", "libmpich.so", "libmpi_ibm.so", "libmpi_cray.so")


def find_libmpi(maps: str = "/proc/self/maps") -> str | None:
    """Path of the MPI library mapped into this process (libmpi.so*, libmpich.so*...), if any."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        name = os.path.basename(path)
        if name.startswith(_LIBMPI) and os.path.exists(path):
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


def forced_cuda_aware(environ: Any = None) -> bool | None:
    """The AIOREADY_MPI_CUDA_AWARE override: True for "1", False for "0", None when unset.

    Anything else raises: a typo such as "yes" must not silently leave detection in charge.
    """
    value = (os.environ if environ is None else environ).get(ENV_CUDA_AWARE)
    if value is None:
        return None
    if value not in ("0", "1"):
        raise ConfigError(f"{ENV_CUDA_AWARE} must say whether MPI takes CUDA device buffers",
                          expected="0 or 1", got=repr(value),
                          fix=f"unset {ENV_CUDA_AWARE} to detect it")
    return value == "1"


_cached: CudaMPISupport | None = None


def cuda_mpi_support(comm: Any = None, *, refresh: bool = False) -> CudaMPISupport:
    """Detect once per process whether MPI is CUDA-aware (MPITransport logs the path taken)."""
    global _cached
    if _cached is not None and not refresh:
        return _cached
    forced = forced_cuda_aware()
    if forced is not None:
        result = CudaMPISupport(forced, "env", None, ENV_CUDA_AWARE)
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
    log.debug("CUDA-aware MPI: %s (%s: %s); %s", result.aware, result.method, result.detail,
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


class PinnedPool:
    """Pinned host buffers lent out and given back, so that each is pinned once.

    Sizes round up to a power of two (at least `min_bytes`), so microbatches of different
    lengths share buffers; at most `max_free_bytes` of given-back buffers are kept, the oldest
    dropped first. `allocate(nbytes)` makes a buffer (a pinned uint8 tensor in HostStager);
    `key(buf)` identifies it, and `give()` takes anything with the key of a lent buffer (a
    tensor viewing its first byte), so the buffer can go back although the caller held a view.
    """

    def __init__(self, allocate: Callable[[int], Any], *,
                 key: Callable[[Any], Hashable] = id, min_bytes: int = 4096,
                 max_free_bytes: int = 512 << 20) -> None:
        self._allocate = allocate
        self._key = key
        self.min_bytes = min_bytes
        self.max_free_bytes = max_free_bytes
        self._free: list[tuple[int, Any]] = []  # (size, buffer), oldest given back first
        self._lent: dict[Hashable, tuple[int, Any]] = {}
        self.free_bytes = 0
        self.num_allocated = self.num_reused = 0

    def size_class(self, nbytes: int) -> int:
        return max(self.min_bytes, 1 << max(nbytes - 1, 0).bit_length())

    def take(self, nbytes: int) -> Any:
        """A buffer of at least `nbytes` that nobody else holds until it is given back."""
        size = self.size_class(nbytes)
        free = self._free
        for i in range(len(free) - 1, -1, -1):  # newest first: its pages may still be cached
            if free[i][0] == size:
                buf = free.pop(i)[1]
                self.free_bytes -= size
                self.num_reused += 1
                break
        else:
            buf = self._allocate(size)
            self.num_allocated += 1
        self._lent[self._key(buf)] = (size, buf)
        return buf

    def give(self, buf: Any) -> None:
        """Take back a lent buffer (or a view of it) for reuse; it must be idle by now."""
        lent = self._lent.pop(self._key(buf), None)
        if lent is None:
            raise InternalError("a pinned buffer was given back that is not lent out",
                                expected="a buffer from take(), given back once",
                                got=f"{type(buf).__name__} {self._key(buf)!r}")
        self._free.append(lent)
        self.free_bytes += lent[0]
        while self.free_bytes > self.max_free_bytes:
            self.free_bytes -= self._free.pop(0)[0]

    @property
    def num_lent(self) -> int:
        return len(self._lent)


class HostStager:
    """Pinned host staging for MPI without CUDA support, per device; copies on their own stream.

    `to_host(t, ready)` waits (on the GPU) for the producer's event, copies into a pooled pinned
    buffer and returns it with the copy's event; `host_buffer()` lends one to receive into and
    `to_device(host)` copies it to the device. `fence(ready)` is an event on the copy stream
    that completes after `ready` (a device buffer handed to MPI directly waits for it). Await
    the events with `completion()`/`wait()` (the completion engine) before handing buffers to
    MPI or reading them, and `release()` host buffers once MPI is done with them. Events of one
    stream complete in order, so awaiting the last of several copies awaits them all.
    """

    def __init__(self, device: Any = None, *, wake: str = "poll",
                 pool: PinnedPool | None = None) -> None:
        import torch
        self._torch = torch
        device = torch.device(device if device is not None else "cuda")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.wake = wake
        self.pool = pool if pool is not None else PinnedPool(self._pin, key=_data_ptr)
        self._source: CUDAEventSource | None = None

    @functools.cached_property
    def stream(self) -> Any:
        """The copy stream, made on the first copy (lending buffers needs none)."""
        return self._torch.cuda.Stream(self.device)

    def _pin(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)

    def _event(self) -> Any:
        return self._torch.cuda.Event(blocking=self.wake in ("thread", "hybrid"))

    def host_buffer(self, shape: Any, dtype: Any) -> Any:
        """A pinned tensor of `shape` and `dtype` over a pooled buffer; `release()` it."""
        nbytes = math.prod(shape) * dtype.itemsize
        return self.pool.take(nbytes)[:nbytes].view(dtype).view(shape)

    def release(self, host: Any) -> None:
        """Give a staging buffer back once MPI and the copies are done with it."""
        self.pool.give(host)

    def to_host(self, t: Any, ready: Any = None) -> tuple[Any, Any]:
        torch = self._torch
        host = self.host_buffer(t.shape, t.dtype)
        with torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # t's memory is not reused before the copy read it
            done = self._event()
            done.record(self.stream)
        return host, done

    def to_device(self, host: Any, out: Any = None) -> tuple[Any, Any]:
        """Copy `host` to the device; a new `out` may be used on the caller's current stream."""
        torch = self._torch
        caller = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            if out is None:
                out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                out.record_stream(caller)  # allocated on the copy stream, used on the caller's
            out.copy_(host, non_blocking=True)
            done = self._event()
            done.record(self.stream)
        return out, done

    def fence(self, ready: Any) -> Any:
        """An event on the copy stream that completes once `ready` has."""
        self.stream.wait_event(ready)
        done = self._event()
        done.record(self.stream)
        return done

    def completion(self, event: Any) -> asyncio.Future[None]:
        """A future that the completion engine resolves once `event` (on the copy stream) has."""
        loop = asyncio.get_running_loop()
        if self._source is None or self._source.loop is not loop:
            self.close()
            self._source = CUDAEventSource(loop, wake=self.wake)
        return self._source.add(event, self.stream.cuda_stream, device=self.device)

    async def wait(self, event: Any) -> None:
        await self.completion(event)

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None


def _data_ptr(t: Any) -> int:
    return t.data_ptr()  # type: ignore[no-any-return]
