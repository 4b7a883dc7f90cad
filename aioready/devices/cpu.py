"""CPU device: a task's compute runs in one worker thread per rank, so the loop stays free to
progress communication while torch computes (torch releases the GIL inside its kernels)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from .base import TaskInfo

__all__ = ["CPUDevice"]

T = TypeVar("T")


class CPUDevice:
    def __init__(self, name: str = "aioready-cpu") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, info: TaskInfo, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __repr__(self) -> str:
        return "<CPUDevice 1 worker>"
