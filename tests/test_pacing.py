"""Pacing on either clock (clock.py): `virtual_clock` tells the loops apart, and a paced task
takes at least its duration, counting an overrun only when its compute alone took longer."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import pytest

from aioready.clock import VirtualClockLoop, clock_of, run_virtual, virtual_clock
from aioready.devices.base import TaskInfo
from aioready.devices.paced import PacedDevice
from aioready.tasks import Kind

pytestmark = pytest.mark.timeout(60)
INFO = TaskInfo(0, 0, 0, 0, 0, Kind.F)


class _Computes:
    """A device whose compute takes `seconds` (a loop sleep, so either clock sees it)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def run(self, info: TaskInfo, fn: Callable[[], Any]) -> Any:
        if self.seconds:
            await asyncio.sleep(self.seconds)
        return fn()

    def close(self) -> None:
        pass


async def _paced(compute_s: float, duration_s: float, mode: str = "floor") -> tuple[int, float]:
    """(overruns, elapsed on the task clock) of one paced task."""
    device = PacedDevice(_Computes(compute_s), lambda info: duration_s, mode)
    now = clock_of(asyncio.get_running_loop())
    start = now()
    assert await device.run(INFO, lambda: "out") == "out"
    return device.num_overruns, now() - start


def test_virtual_clock_is_the_loop_only_on_simulated_time() -> None:
    async def which() -> VirtualClockLoop | None:
        return virtual_clock(asyncio.get_running_loop())
    assert asyncio.run(which()) is None
    loop = run_virtual(which())
    assert isinstance(loop, VirtualClockLoop)
    assert clock_of(loop) == loop.time
    plain = asyncio.new_event_loop()
    try:
        assert clock_of(plain) is time.monotonic
    finally:
        plain.close()


def test_paced_tasks_on_the_virtual_clock() -> None:
    assert run_virtual(_paced(0.5, 2.0)) == (0, 2.0)  # compute, then the rest of the duration
    assert run_virtual(_paced(3.0, 2.0)) == (1, 3.0)  # the compute alone took longer


def test_add_mode_sleeps_the_whole_duration_after_the_compute() -> None:
    assert run_virtual(_paced(0.5, 2.0, "add")) == (0, 2.5)
    assert run_virtual(_paced(3.0, 2.0, "add")) == (0, 5.0)  # no overrun: nothing to fit in
    assert run_virtual(_paced(0.0, 2.0, "add")) == (0, 2.0)


def test_pacing_mode_is_checked() -> None:
    from aioready.errors import ConfigError
    with pytest.raises(ConfigError, match="floor | add"):
        PacedDevice(_Computes(0.0), lambda info: 1.0, "at-least")


async def test_paced_tasks_on_a_real_loop() -> None:
    overruns, took = await _paced(0.0, 0.2)
    assert overruns == 0 and took >= 0.2  # it slept the rest, which is no overrun
    overruns, took = await _paced(0.2, 0.05)
    assert overruns == 1 and took >= 0.2


def test_a_paced_task_tells_the_completion_engine_when_it_ends() -> None:
    """The deadline a paced task sleeps to reaches the loop's engine (`task_ends_at`), which
    can fit its busy parks to it (progress.py `task_lead_s`); with no engine, nothing is made."""
    from aioready.progress import ProgressConfig, ProgressEngine

    async def main() -> tuple[list[float], bool]:
        loop = asyncio.get_running_loop()
        assert ProgressEngine.existing(loop) is None
        await _paced(0.5, 2.0)
        made = ProgressEngine.existing(loop) is not None
        engine = ProgressEngine.for_loop(loop)
        engine.reconfigure(ProgressConfig(task_lead_s=1e-3))
        told: list[float] = []
        engine.task_ends_at = told.append  # type: ignore[method-assign]
        await _paced(0.5, 2.0)
        await _paced(0.5, 2.0, "add")
        engine.close()
        return told, made

    told, made = run_virtual(main())
    assert told == [2.0 + 2.0, 4.0 + 0.5 + 2.0] and not made
