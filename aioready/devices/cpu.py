"""CPU device: a task's compute runs in one worker thread per rank, so the loop stays free to
progress communication while torch computes (torch releases the GIL inside its kernels).

The hand-off to the thread and back costs more than a tiny stage computes (25-60 us a task on a
loaded 2-core host, bench/hot_path.py), and while the thread computes the loop still wakes for
the completion engine's busy parks: in bench.e2e's 1F1B (4 ranks, 20-40 ms tasks) the loop
thread woke ~6 times a task and spent ~1 ms of CPU a task against ~0.6 ms with the compute on
it (docs/hot_path_measurements.md "CPU per task beyond the model"). So two paths put a task on
the loop thread:

- **quiet** (`quiet_inline`, env `AIOREADY_CPU_QUIET_INLINE`): when the loop has nothing else
  to do. By default only on a loop that `aioready.run` made (the CLI, a launched script:
  `launch.owns_loop`): a service that embeds a pipeline in its own loop keeps that loop serving
  while a task computes, and so do a rank's heartbeats to its peers (a task longer than the peer
  timeout on the quiet path would look like a lost rank to them). Then: this is the only open
  CPUDevice of the process (no other rank, and no in-process tensor-parallel peer whose
  collective would wait on this loop), the engine
  polls one completion source (the rank's transport: no DP reducer or CUDA events whose requests
  only move when polled), no transfer in flight needs its polling (`wants_hot`: a
  rendezvous-size message), and torch's grad mode on the loop thread is the worker's (enabled).
  Messages that arrive meanwhile wait in MPI until the task ends; one engine poll then hands
  them to the rank before the arbiter decides, as the busy parks would have. The cost: a large
  *incoming* transfer is matched only when the task ends. Turn it off for stages that compute
  long and receive large tensors.
- **tiny** (`inline_below_s`, env `AIOREADY_CPU_INLINE_US`, off by default): a task whose
  previous run of the same stage and kind took less than that, whatever else runs. Every first
  run, and every run after one that took longer, goes to the thread.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from ..errors import ConfigError
from ..launch import owns_loop
from ..progress import ProgressEngine
from .base import TaskInfo

__all__ = ["CPUDevice"]

T = TypeVar("T")

_OPEN: weakref.WeakSet[CPUDevice] = weakref.WeakSet()  # open devices of this process


def _inline_below_from_env() -> float:
    text = os.environ.get("AIOREADY_CPU_INLINE_US", "0")
    try:
        value = float(text) * 1e-6
    except ValueError:
        raise ConfigError("AIOREADY_CPU_INLINE_US is not a number", expected="microseconds",
                          got=repr(text)) from None
    if not value >= 0:
        raise ConfigError("AIOREADY_CPU_INLINE_US must be >= 0", expected=">= 0", got=text)
    return value


def _quiet_inline_from_env() -> bool | None:
    """None (unset): on exactly where the loop is aioready's own (module note)."""
    text = os.environ.get("AIOREADY_CPU_QUIET_INLINE")
    if text is None:
        return None
    if text not in ("0", "1"):
        raise ConfigError("AIOREADY_CPU_QUIET_INLINE", expected="0 or 1 (or unset: on only on "
                          "a loop aioready.run made)", got=repr(text))
    return text == "1"


def _grad_enabled() -> bool:
    """The loop thread's torch grad mode (thread-local; the worker thread's is on)."""
    torch = sys.modules.get("torch")
    return torch is None or bool(torch.is_grad_enabled())


def _quiet(engine: ProgressEngine | None) -> bool:
    """Nothing on the loop needs polling while a task computes: one completion source (the
    rank's transport; a DP reducer or CUDA events are a second one, whose requests progress
    only when polled) and no transfer in flight that wants the engine hot (its own test)."""
    return engine is None or (engine.statistics().num_sources <= 1
                              and not engine.wants_hot())


class CPUDevice:
    def __init__(self, name: str = "aioready-cpu", *, inline_below_s: float | None = None,
                 quiet_inline: bool | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.inline_below_s = (_inline_below_from_env() if inline_below_s is None
                               else inline_below_s)
        self.quiet_inline = (_quiet_inline_from_env() if quiet_inline is None
                             else quiet_inline)  # None: on aioready's own loop only
        self._last: dict[tuple[int, int], float] = {}  # (stage, kind) -> last compute time (s)
        self.num_inline = 0  # tasks run on the loop thread by the tiny-task path
        self.num_quiet = 0  # tasks run on the loop thread by the quiet path
        _OPEN.add(self)

    async def run(self, info: TaskInfo, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        if (self.quiet_inline is not False and len(_OPEN) == 1
                and (self.quiet_inline or owns_loop(loop))):
            engine = ProgressEngine.existing(loop)
            if _quiet(engine) and _grad_enabled():
                self.num_quiet += 1
                if engine is None:
                    return self._timed((info.stage, info.kind), fn)
                engine.inline_task_begins()  # no rings into a loop that cannot answer them
                try:
                    return self._timed((info.stage, info.kind), fn)
                finally:  # what arrived meanwhile, before the next decision
                    engine.inline_task_ends()
        if not self.inline_below_s:
            return await loop.run_in_executor(self._pool, fn)
        key = (info.stage, info.kind)
        last = self._last.get(key)
        if last is not None and last < self.inline_below_s:
            self.num_inline += 1
            return self._timed(key, fn)
        return await loop.run_in_executor(self._pool, self._timed, key, fn)  # type: ignore[arg-type]

    def _timed(self, key: tuple[int, int], fn: Callable[[], Any]) -> Any:
        """Run `fn` and record its compute time alone (not the hand-off)."""
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self._last[key] = time.perf_counter() - t0

    def close(self) -> None:
        _OPEN.discard(self)
        self._pool.shutdown(wait=True)

    def __repr__(self) -> str:
        paths = []
        if self.inline_below_s:
            paths.append(f"inline below {self.inline_below_s * 1e6:.0f} us")
        if self.quiet_inline is not False:
            paths.append("inline when quiet" + ("" if self.quiet_inline else " on its own loop"))
        return "<CPUDevice 1 worker" + "".join(", " + p for p in paths) + ">"
