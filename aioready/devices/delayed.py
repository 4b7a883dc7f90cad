"""Delayed device: a task holds its device for an extra, injected time after its compute.

Used to model uneven ranks (stragglers, per-rank jitter) around a real device, e.g. to make the
members of a tensor-parallel group see readiness at different moments. The delay is an asyncio
sleep after the compute, so the loop stays free and the task's output leaves only afterwards.
"""

from __future__ import annotations

import asyncio
from typing import Callable, TypeVar

from .base import Device, TaskInfo

__all__ = ["DelayedDevice"]

T = TypeVar("T")


class DelayedDevice:
    def __init__(self, inner: Device, delay: Callable[[TaskInfo], float]) -> None:
        self.inner = inner
        self.delay = delay

    async def run(self, info: TaskInfo, fn: Callable[[], T]) -> T:
        result = await self.inner.run(info, fn)
        extra = self.delay(info)
        if extra > 0:
            await asyncio.sleep(extra)
        return result  # type: ignore[no-any-return]

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"<DelayedDevice over {self.inner!r}>"
