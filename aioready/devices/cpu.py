"""CPU device: a task's compute runs in one worker thread per rank, so the loop stays free to
progress communication while torch computes (torch releases the GIL inside its kernels).

The hand-off to the thread and back to the loop costs 25-60 us per task on a loaded 2-core host
(bench/hot_path.py), more than a tiny stage computes. With `inline_below_s` (env
`AIOREADY_CPU_INLINE_US`, off by default) a task whose previous run of the same stage and kind
took less than that runs on the loop thread instead, as the inline device would; every first
run, and every run after one that took longer, goes to the thread. Off by default because a task
that blocks on its peers (an in-process tensor-parallel group's collectives) must never hold the
loop: turn it on for pipelines whose stage work is tiny.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from ..errors import ConfigError
from .base import TaskInfo

__all__ = ["CPUDevice"]

T = TypeVar("T")


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


class CPUDevice:
    def __init__(self, name: str = "aioready-cpu", *, inline_below_s: float | None = None
                 ) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.inline_below_s = (_inline_below_from_env() if inline_below_s is None
                               else inline_below_s)
        self._last: dict[tuple[int, int], float] = {}  # (stage, kind) -> last compute time (s)
        self.num_inline = 0

    async def run(self, info: TaskInfo, fn: Callable[[], T]) -> T:
        if not self.inline_below_s:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        key = (info.stage, info.kind)
        last = self._last.get(key)
        if last is not None and last < self.inline_below_s:
            self.num_inline += 1
            return self._timed(key, fn)
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self._timed, key, fn)  # type: ignore[arg-type]

    def _timed(self, key: tuple[int, int], fn: Callable[[], Any]) -> Any:
        """Run `fn` and record its compute time alone (not the hand-off)."""
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self._last[key] = time.perf_counter() - t0

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __repr__(self) -> str:
        inline = (f", inline below {self.inline_below_s * 1e6:.0f} us"
                  if self.inline_below_s else "")
        return f"<CPUDevice 1 worker{inline}>"
