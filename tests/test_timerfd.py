"""Precise sleeps (timerfd.py): a real loop's `sleep_until` ends on one timerfd wake-up, never
before its deadline, on the default loop and on uvloop; sleeps of one loop share the timer in
deadline order; `AIOREADY_PRECISE_SLEEP=0` keeps the loop's own timers."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import uvloop

from aioready.clock import run_virtual, sleep_until
from aioready.timerfd import LoopTimer, TimerFd

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd: Linux")]

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


class _CountingSleep:
    """Counts asyncio.sleep calls: the precise path makes none."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = asyncio.sleep

        async def sleep(delay: float, result: object = None) -> object:
            self.calls += 1
            return await real(delay, result)

        monkeypatch.setattr(asyncio, "sleep", sleep)


def _run(kind: str, coro_fn) -> object:  # type: ignore[no-untyped-def]
    loop = LOOPS[kind]()
    try:
        return loop.run_until_complete(coro_fn())
    finally:
        loop.close()


@pytest.mark.parametrize("kind", sorted(LOOPS))
def test_sleep_until_ends_on_one_timer_wake_up_not_before_its_deadline(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = _CountingSleep(monkeypatch)

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        late = []
        for i in range(20):
            deadline = time.monotonic() + 0.003 + i * 1.3e-4
            assert await sleep_until(loop, deadline)
            late.append(time.monotonic() - deadline)
        return late

    late = _run(kind, main)
    assert min(late) >= 0  # type: ignore[type-var]
    assert counter.calls == 0  # no loop timer, so no early end to sleep the rest of


@pytest.mark.parametrize("kind", sorted(LOOPS))
def test_switch_off_sleeps_on_the_loop_timers(kind: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOREADY_PRECISE_SLEEP", "0")
    counter = _CountingSleep(monkeypatch)

    async def main() -> float:
        deadline = time.monotonic() + 0.004
        assert await sleep_until(asyncio.get_running_loop(), deadline)
        return time.monotonic() - deadline

    assert _run(kind, main) >= 0  # type: ignore[operator]
    assert counter.calls >= 1


def test_sleeps_of_one_loop_share_the_timer_in_deadline_order() -> None:
    async def main() -> tuple[list[int], list[float], int]:
        loop = asyncio.get_running_loop()
        timer = LoopTimer.for_loop(loop)
        assert timer is not None and LoopTimer.for_loop(loop) is timer
        now = time.monotonic()
        order: list[int] = []
        late: list[float] = []
        offsets = [0.012, 0.004, 0.008, 0.004, 0.001]

        async def one(i: int) -> None:
            await timer.sleep_until(now + offsets[i])
            order.append(i)
            late.append(time.monotonic() - (now + offsets[i]))

        cancelled = loop.create_task(timer.sleep_until(now + 0.002))
        tasks = [loop.create_task(one(i)) for i in range(len(offsets))]
        await asyncio.sleep(0)
        cancelled.cancel()  # a sleep given up early leaves the others on time
        await asyncio.gather(*tasks)
        past = time.monotonic() - 1.0
        await timer.sleep_until(past)  # a deadline already passed ends at once
        return order, late, len(timer._heap)

    order, late, left = asyncio.run(main())
    assert order == [4, 1, 3, 2, 0]  # equal deadlines end in the order they began
    assert min(late) >= 0
    assert left == 0


def test_bare_timer_fires_at_an_absolute_deadline() -> None:
    import select
    timer = TimerFd()
    try:
        deadline = time.monotonic() + 0.003
        timer.arm_at(deadline)
        assert select.select([timer.fd], [], [], 5.0)[0] == [timer.fd]
        assert time.monotonic() >= deadline
        timer.drain()
        assert select.select([timer.fd], [], [], 0)[0] == []  # one-shot: drained, quiet
        timer.arm(0.002)  # relative, as the completion engine's parks use it
        assert select.select([timer.fd], [], [], 5.0)[0] == [timer.fd]
    finally:
        timer.close()


def test_virtual_clock_sleeps_are_untouched() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        assert await sleep_until(loop, loop.time() + 2.5)
        return loop.time()

    assert run_virtual(main()) == 2.5
