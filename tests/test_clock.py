"""The virtual clock at large magnitudes: it must move (or refuse), never spin.

asyncio fires a timer once `when < now + 1e-9`; past ~1.7e7 that sum rounds to `now` and a
due timer was never run: the loop spun at 100 % CPU (a trace in ns instead of ms). Each test has
a short timeout, so the old behaviour fails instead of hanging."""

from __future__ import annotations

import asyncio

import pytest

from aioready import simulate
from aioready.clock import VirtualClockOverflow, run_virtual
from aioready.errors import ConfigError
from aioready.sim.durations import BaseDurations

pytestmark = pytest.mark.timeout(20)


@pytest.mark.parametrize("start", [0.0, 1.7e7, 1e8, 1e15])
def test_sleeps_land_on_their_deadlines_at_any_magnitude(start: float) -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        seen = []
        for _ in range(3):
            await asyncio.sleep(0.25)
            seen.append(loop.time())
        return seen

    expected, t = [], start
    for _ in range(3):
        t = t + 0.25
        expected.append(t)
    assert run_virtual(main(), start=start) == expected


def test_simulation_in_nanoseconds_runs_like_in_milliseconds() -> None:
    ms = simulate(stages=4, microbatches=8, mode="strict", base=BaseDurations(f=1.0, b=2.0))
    ns = simulate(stages=4, microbatches=8, mode="strict", base=BaseDurations(f=1e6, b=2e6))
    assert ns.step_time == ms.step_time * 1e6
    huge = simulate(stages=4, microbatches=8, jitter="multimodal:1:1e200")
    assert huge.step_time > 1e200  # no spin; the figures are what they are


def test_a_time_that_is_not_finite_is_refused() -> None:
    async def main() -> None:
        await asyncio.sleep(1e308)
        await asyncio.sleep(1e308)  # overflows to inf

    with pytest.raises(VirtualClockOverflow, match="must be finite") as info:
        run_virtual(main())
    assert isinstance(info.value, ConfigError)
