"""Sim device: a task occupies the device for a duration given by a model or a trace.

The real compute (optional) runs inline on the loop thread, then the task sleeps for whatever is
left of its duration, so a task takes at least its given duration ("real compute plus a sleep for
the rest"). On the simulator's virtual clock the compute takes no time and the sleep is exact.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, TypeVar

from ..clock import clock_of, sleep_until
from .base import TaskInfo

__all__ = ["SimDevice", "DurationFn"]

T = TypeVar("T")
DurationFn = Callable[[TaskInfo], float]  # seconds


class SimDevice:
    def __init__(self, duration: DurationFn, *, run_compute: bool = True) -> None:
        self.duration = duration
        self.run_compute = run_compute
        self._loop: asyncio.AbstractEventLoop | None = None
        self._now: Callable[[], float] = time.monotonic

    async def run(self, info: TaskInfo, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # the clock is looked up once per loop, not twice a task
            self._loop, self._now = loop, clock_of(loop)
        start = self._now()
        result = fn() if self.run_compute else None
        deadline = start + self.duration(info)
        if deadline > self._now():  # else sleep_until would return at once, not waiting
            await sleep_until(loop, deadline)
        return result  # type: ignore[return-value]

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<SimDevice compute={'on' if self.run_compute else 'off'}>"
