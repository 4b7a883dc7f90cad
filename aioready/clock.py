"""A virtual-clock event loop: simulated time passes instantly and deterministically.

`VirtualClockLoop` is the default selector loop with `time()` replaced by a counter. When the loop
has nothing ready to run and no file descriptor is ready, it jumps the clock straight to the
earliest scheduled timer instead of sleeping (the idea of the `looptime` package, written here in a
few lines so the simulator needs no extra dependency and no uvloop). The jump sets the clock to the
timer's own deadline, so times add up exactly (no `now + (when - now)` rounding).

Same-instant order: asyncio runs every callback that is ready, then timers that are due, in
deadline order and then in scheduling order. On top of that, `wait_idle()` returns a future that
resolves only once nothing else is left to run at the current instant (no ready callback, no due
timer), before the clock moves; waiters are released in the order they began to wait. The arbiter
awaits it before every decision, so every completion and message of an instant is seen before any
rank decides what to run next (docs/architecture.md "The simulator": completions before the
arbiter's next decision). With no threads in the process this makes a run a pure function of its
inputs.

Large times: the clock's resolution grows with it (see `_advance`), so a simulation in
nanoseconds, or a clock started at 1e8, runs instead of spinning; a time that is not finite raises
VirtualClockOverflow.

If nothing is ready, no timer is scheduled and nothing is being waited for on a descriptor, the
program can never progress: the loop raises VirtualClockDeadlock instead of blocking forever.

Test mode (`shuffle_seed`): timers due at the same instant fire in a seeded random order, spread
over a random number of loop passes (as timers microseconds apart would on a real loop), and idle
waiters are released in a random order, to expose code that silently relies on one order of tied
events (trio randomises its run queue the same way). Same-seed runs stay identical. asyncio's
documentation leaves the order of callbacks scheduled for the same time undefined, so a correct
program gives the same result in this mode.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import os
import random
import selectors
import time
from typing import Any, Awaitable, Callable, TypeVar

from .errors import ConfigError
from .timerfd import LoopTimer

__all__ = ["VirtualClockLoop", "VirtualClockDeadlock", "VirtualClockOverflow", "run_virtual", "virtual_clock", "clock_of",
           "sleep_until"]

T = TypeVar("T")


class VirtualClockDeadlock(RuntimeError):
    """Raised when the simulated program waits with no timer and no I/O that could wake it."""


class VirtualClockOverflow(ConfigError):
    """Raised when a simulated timer is due at a time that is not finite."""


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualClockLoop | None = None

    def select(self, timeout: float | None = None) -> list[Any]:
        loop = self.loop
        assert loop is not None
        if loop._ties is None:
            return self._select(loop, timeout)
        if loop._held:  # tied timers held back last pass: still due, the instant goes on
            for timer in loop._held:
                heapq.heappush(loop._scheduled, timer)  # type: ignore[attr-defined]
            loop._held = []
            events = super().select(0)
        else:
            events = self._select(loop, timeout)
        loop._hold_some_ties()
        return events

    def _select(self, loop: VirtualClockLoop, timeout: float | None) -> list[Any]:
        if timeout == 0 and len(self.get_map()) == 1:
            # callbacks are ready and only the loop's self-pipe is registered (a simulation):
            # nothing to poll for, since a thread's call_soon_threadsafe queues its callback
            # itself and the pipe only wakes a sleeping loop. The poll was 4 % of a tuner's
            # choice at S=32 (docs/policy.md "What a choice costs")
            return []
        events = super().select(0)
        if events or timeout == 0:
            return events
        if loop._idle:  # the instant is over: release the decisions waiting for it
            waiters, loop._idle = loop._idle, []
            if loop._ties is not None:
                loop._ties.shuffle(waiters)
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
            return []
        scheduled = loop._scheduled  # type: ignore[attr-defined]
        if scheduled:
            loop._advance(scheduled[0].when())
            return []
        if len(self.get_map()) > 1:  # descriptors other than the loop's self-pipe
            return super().select(timeout)
        raise VirtualClockDeadlock(
            f"virtual clock at {loop._now:.6f}: nothing is ready and nothing is scheduled")


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose clock only moves when the loop would otherwise sleep."""

    def __init__(self, start: float = 0.0, *, shuffle_seed: int | None = None) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = start
        self._idle: list[asyncio.Future[None]] = []
        self._ties = None if shuffle_seed is None else random.Random(shuffle_seed)
        self._held: list[asyncio.TimerHandle] = []
        self._base_resolution = self._clock_resolution
        self._advance(start)

    def _advance(self, when: float) -> None:
        """Jump to `when`. asyncio fires a timer once `when < now + resolution`; its resolution
        (1 ns) vanishes next to a large clock (at 1.7e7, now + 1e-9 == now), so the timer would
        never be due and the loop would spin forever: the resolution grows with the clock to
        two units in the last place. A time that is not finite is refused."""
        if not math.isfinite(when):
            raise VirtualClockOverflow(
                f"virtual clock at {self._now:.6g}: a timer is due at {when!r}; simulated "
                "durations must be finite (a unit mix-up, e.g. ns for ms, or a jitter too wide)")
        self._now = max(self._now, when)
        self._clock_resolution = max(self._base_resolution, 2 * math.ulp(self._now))

    def _hold_some_ties(self) -> None:
        """Of the timers due now, let a random nonempty part fire in this pass and hold the rest
        for the next ones, as timers a few microseconds apart would fire on a real loop: tied
        events reach the program in a random order and in separate passes."""
        scheduled = self._scheduled  # type: ignore[attr-defined]
        end = self._now + self._clock_resolution  # what asyncio's _run_once counts as due
        due = []
        while scheduled and scheduled[0].when() < end:
            due.append(heapq.heappop(scheduled))
        if due:
            assert self._ties is not None
            self._ties.shuffle(due)
            keep = self._ties.randint(1, len(due))
            for timer in due[:keep]:
                heapq.heappush(scheduled, timer)
            self._held = due[keep:]

    def time(self) -> float:
        return self._now

    def wait_idle(self) -> asyncio.Future[None]:
        """A future that resolves when nothing else is left to run at the current instant."""
        fut = self.create_future()
        self._idle.append(fut)
        return fut


def run_virtual(main: Awaitable[T], *, start: float = 0.0, shuffle_seed: int | None = None) -> T:
    """Run `main` to completion on a fresh VirtualClockLoop (`shuffle_seed`: the test mode)."""
    with asyncio.Runner(loop_factory=lambda: VirtualClockLoop(
            start, shuffle_seed=shuffle_seed)) as runner:
        return runner.run(main)  # type: ignore[arg-type]


def virtual_clock(loop: asyncio.AbstractEventLoop) -> VirtualClockLoop | None:
    """`loop` if it runs on simulated time, else None: the one test for "is this simulated?"
    (the arbiter settles each instant, devices trust their sleeps, watchdogs default to off)."""
    return loop if isinstance(loop, VirtualClockLoop) else None


def clock_of(loop: asyncio.AbstractEventLoop) -> Callable[[], float]:
    """The clock that task spans and device pacing read: the loop's own on a virtual clock, else
    `time.monotonic` -- the clock asyncio's default loop uses, at full resolution, where uvloop's
    `loop.time()` only moves in whole milliseconds (too coarse for tasks of a few ms)."""
    virtual = virtual_clock(loop)
    return time.monotonic if virtual is None else virtual.time


async def sleep_until(loop: asyncio.AbstractEventLoop, deadline: float) -> bool:
    """Sleep until `clock_of(loop)` reads `deadline`; False if it already had (nothing to wait).

    On a real Linux loop it ends on a timerfd armed at the deadline (timerfd.py; off with
    `AIOREADY_PRECISE_SLEEP=0`). Otherwise a sleep can end early against time.monotonic
    (uvloop's timers run on a clock cached per loop pass): sleep the rest. The virtual clock
    lands on the timer exactly.
    """
    now = clock_of(loop)
    left = deadline - now()
    if left <= 0:
        return False
    virtual = virtual_clock(loop) is not None
    if not virtual and os.environ.get("AIOREADY_PRECISE_SLEEP", "1") != "0":
        timer = LoopTimer.for_loop(loop)  # one wake-up at the deadline (timerfd.py)
        if timer is not None:
            await timer.sleep_until(deadline)
            return True
    while left > 0:
        await asyncio.sleep(left)
        if virtual:
            break
        left = deadline - now()
    return True
