"""CUDA device: a stage's compute is enqueued on its own stream; its end is an awaited event.

`run(info, fn)` calls `fn` on the loop thread inside `torch.cuda.stream(s)`: torch only enqueues
kernels, so this returns quickly. An event recorded on `s` after the work is then awaited through
the completion engine (cuda/events.py, CUDAEventSource), so the loop never blocks in a synchronize.
`run` returns once the event completed, so anything that sends or consumes the outputs (an MPI
Isend, the next stage) sees finished data: communication waits for the producing event, not for
the whole device.

Streams and the caching allocator: a tensor made on stream A and used on stream B (in-process
stages sharing a GPU, the runtime summing losses on the default stream) must not have its memory
handed out again on A while B's kernels may still read it. So every CUDA tensor a task receives
is marked `record_stream(s)` of the consuming stream, and every CUDA tensor it returns is marked
for the loop thread's current stream. Inputs from another stage need no `wait_event`: the
consumer's kernels are enqueued only after the host saw the producer's event complete. Work the
loop thread left on its current stream (the caller's inputs, a transport's host-to-device copy)
is not observed by the host, so `s` waits for that stream first (`wait_stream`, on the GPU).
Tensors on the CPU or another GPU are copied to this device on `s` before `fn` runs.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import Any, Callable, TypeVar

import torch

from ..cuda.events import WAKE_MODES, CUDAEventSource
from ..errors import ConfigError
from .base import TaskInfo

__all__ = ["CUDADevice", "cuda_available", "DEFAULT_WAKE"]

T = TypeVar("T")

# Measured on an H200 (bench/gpu_check.py, bench/results/gpu.md): hot polling learns of a
# completion 2-18 us after a spinning synchronize(); the parked wakes (thread, hostfn) take
# 30-260 us. `hybrid` cuts the CPU of long tasks for ~0.15 ms more. AIOREADY_CUDA_WAKE overrides.
DEFAULT_WAKE = "poll"


def cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _device_of(rank_or_device: Any) -> torch.device:
    if isinstance(rank_or_device, torch.device):
        dev = rank_or_device
    elif isinstance(rank_or_device, str):
        dev = torch.device(rank_or_device)
    elif isinstance(rank_or_device, int) and not isinstance(rank_or_device, bool):
        if rank_or_device < 0:
            raise ConfigError("CUDADevice: rank or device index must be >= 0",
                              expected=">= 0", got=rank_or_device)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError("device='cuda' but torch sees no CUDA device",
                              expected="a CUDA GPU", got=f"torch {torch.__version__}, "
                              f"cuda available={torch.cuda.is_available()}",
                              fix="use device='cpu'")
        dev = torch.device("cuda", rank_or_device % count)
    else:
        raise ConfigError("CUDADevice takes a rank, a device index or a torch.device",
                          expected="int | str | torch.device", got=repr(rank_or_device))
    if dev.type != "cuda":
        raise ConfigError("CUDADevice needs a CUDA device", expected="cuda[:N]", got=str(dev))
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class CUDADevice:
    """One stage stream per device object; task ends are events awaited via the engine.

    `CUDADevice(rank)` uses GPU `rank % device_count` (one process per GPU under MPI, or several
    in-process stages sharing GPUs). `wake` is how the loop learns of completions (see
    cuda/events.py). With `timing=True` each task also records timing events, kept in `timings`
    as (info, start_event, end_event), for GPU busy fractions.
    """

    def __init__(self, rank_or_device: Any = 0, *, wake: str | None = None,
                 timing: bool = False, stream: torch.cuda.Stream | None = None) -> None:
        self.device = _device_of(rank_or_device)
        wake = wake or os.environ.get("AIOREADY_CUDA_WAKE") or DEFAULT_WAKE
        if wake not in WAKE_MODES:
            raise ConfigError("unknown CUDA wake mode", expected=" | ".join(WAKE_MODES),
                              got=repr(wake))
        self.wake = wake
        self.stream = stream if stream is not None else torch.cuda.Stream(self.device)
        self.timing = timing
        self.timings: list[tuple[TaskInfo, torch.cuda.Event, torch.cuda.Event]] = []
        self._source: CUDAEventSource | None = None
        self._free: list[torch.cuda.Event] = []
        self.num_tasks = 0
        self.enqueue_s = 0.0  # host time spent launching tasks' work (on the loop thread)
        self.wait_s = 0.0  # time from the last launch to the host learning of completion

    def _source_for(self, loop: asyncio.AbstractEventLoop) -> CUDAEventSource:
        src = self._source
        if src is None or src.loop is not loop:
            if src is not None:
                src.close()
            src = self._source = CUDAEventSource(loop, wake=self.wake)
        return src

    def _event(self) -> torch.cuda.Event:
        if self._free:
            return self._free.pop()
        return torch.cuda.Event(blocking=self.wake in ("thread", "hybrid"))

    def _adopt(self, value: Any) -> Any:
        """Make a task input usable on this stream (see the module docstring)."""
        if isinstance(value, torch.Tensor):
            if value.device == self.device:
                value.record_stream(self.stream)
                return value
            return value.to(self.device, non_blocking=True)
        if isinstance(value, tuple):
            return tuple(self._adopt(v) for v in value)
        if isinstance(value, list):
            return [self._adopt(v) for v in value]
        return value

    def _prepare(self, fn: Callable[[], T]) -> Callable[[], T]:
        if isinstance(fn, functools.partial):
            return functools.partial(fn.func, *(self._adopt(a) for a in fn.args),
                                     **{k: self._adopt(v) for k, v in fn.keywords.items()})
        return fn

    def _release(self, value: Any, stream: torch.cuda.Stream) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_cuda and value.device == self.device:
                value.record_stream(stream)
        elif isinstance(value, (tuple, list)):
            for v in value:
                self._release(v, stream)

    async def run(self, info: TaskInfo, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        source = self._source_for(loop)
        t0 = time.perf_counter()
        outer = torch.cuda.current_stream(self.device)
        # Work the loop thread enqueued on its own stream (inputs made by the caller, a
        # transport's host-to-device copy) is ordered before this task on the GPU.
        self.stream.wait_stream(outer)
        with torch.cuda.stream(self.stream):
            start = None
            if self.timing:
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
            result = self._prepare(fn)()
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record(self.stream)
                self.timings.append((info, start, end))
            event = self._event()
            event.record(self.stream)
        self._release(result, outer)
        self.num_tasks += 1
        t1 = time.perf_counter()
        await source.add(event, self.stream.cuda_stream, device=self.device)
        self.enqueue_s += t1 - t0
        self.wait_s += time.perf_counter() - t1
        if self.wake == "poll":  # elsewhere a waiter may still hold it: never re-record those
            self._free.append(event)
        return result

    def synchronize(self) -> None:
        """Block until this device's stream is idle (for tests and checks, not the hot path)."""
        self.stream.synchronize()

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None

    def __repr__(self) -> str:
        return f"<CUDADevice {self.device} wake={self.wake} tasks={self.num_tasks}>"
