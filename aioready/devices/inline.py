"""Inline device: a task's compute runs on the loop thread itself.

The trade-off against CPUDevice: no thread hand-off and no GIL contention between the loop and a
compute thread (measured in bench/e2e on 2 cores: about half the CPU per step for a small model),
but the loop runs nothing else while a task computes, so a large (rendezvous) transfer waits for
the task to end. Suits small CPU models and ranks that own a core; CPUDevice stays the default,
and itself computes on the loop thread while that is safe (its quiet path, devices/cpu.py).
"""

from __future__ import annotations

from typing import Callable, TypeVar

from .base import TaskInfo

__all__ = ["InlineDevice"]

T = TypeVar("T")


class InlineDevice:
    async def run(self, info: TaskInfo, fn: Callable[[], T]) -> T:
        return fn()

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return "<InlineDevice on the loop thread>"
