"""Paced device: a task takes at least its given duration, with its real compute inside.

It wraps another device (the CPU worker thread, so the loop stays free while torch computes),
runs the task's compute there and then sleeps for whatever is left of the duration: "real compute
plus a sleep for the rest" (mode "floor"). Mode "add" sleeps the whole duration after the
compute instead, as a sleep injected into the model does in other runtimes' harnesses, so one set
of durations replays on equal terms in both. Used to replay jitter models and traces on a real
model (aioready train, the demo). Unlike SimDevice, the compute does not run on the loop thread
unless the inner device puts it there (CPUDevice's quiet path, when nothing else needs the loop).
"""

from __future__ import annotations

import asyncio
from typing import Callable, TypeVar

from ..clock import clock_of, sleep_until
from ..errors import ConfigError
from ..progress import ProgressEngine
from .base import Device, TaskInfo

__all__ = ["PacedDevice", "PACE_MODES"]

PACE_MODES = ("floor", "add")

T = TypeVar("T")


class PacedDevice:
    def __init__(self, inner: Device, duration: Callable[[TaskInfo], float],
                 mode: str = "floor") -> None:
        if mode not in PACE_MODES:
            raise ConfigError("pacing mode", expected=" | ".join(PACE_MODES), got=repr(mode))
        self.inner = inner
        self.duration = duration
        self.mode = mode
        self.num_overruns = 0  # floor: tasks whose compute alone took longer than their duration

    async def run(self, info: TaskInfo, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        start = clock_of(loop)()
        result = await self.inner.run(info, fn)
        if self.mode == "add":
            start = clock_of(loop)()
        deadline = start + self.duration(info)
        engine = ProgressEngine.existing(loop)
        if engine is not None:
            engine.task_ends_at(deadline)  # its busy parks can fit the task (progress.py)
        if not await sleep_until(loop, deadline) and self.mode == "floor":
            self.num_overruns += 1
        return result

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"<PacedDevice over {self.inner!r}, overruns={self.num_overruns}>"
