"""Precise timers on Linux: a one-shot CLOCK_MONOTONIC timerfd, and sleeps that end on one.

Why not `asyncio.sleep` for a task's duration: uvloop's timers count whole milliseconds from a
clock cached at the start of each loop pass, so a 10 ms sleep often ends up to ~1 ms early, and
the rest (`clock.sleep_until` sleeps it) rounds to a 0 ms timer: the loop spins for it, ~20
passes and 50-250 us of CPU a task (measured: docs/hot_path_measurements.md "A task's end:
one precise wake-up"). The default loop rounds its epoll timeout up to the next millisecond
instead, so it wakes up to 1 ms late. A timerfd armed at the absolute deadline wakes the loop
once, on time.

`LoopTimer` is one timerfd per event loop, watched with `loop.add_reader` for the loop's life and
armed at the earliest pending deadline; `TimerFd` is the bare timer (the completion engine parks
on its own one). Neither exists off Linux or on a loop without `add_reader` (`for_loop` says so).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import heapq
import os
import sys
import time
import weakref

__all__ = ["LoopTimer", "TimerFd"]


class TimerFd:
    """A one-shot CLOCK_MONOTONIC timerfd: os.timerfd_* on 3.13+, libc through ctypes before."""

    def __init__(self) -> None:
        if hasattr(os, "timerfd_create"):
            self.fd = os.timerfd_create(time.CLOCK_MONOTONIC,
                                        flags=os.TFD_NONBLOCK | os.TFD_CLOEXEC)
            self._closer = weakref.finalize(self, os.close, self.fd)
            fd = self.fd

            def _set_native(seconds: float, absolute: bool) -> None:
                if absolute:
                    os.timerfd_settime(fd, flags=os.TFD_TIMER_ABSTIME, initial=seconds)
                else:
                    os.timerfd_settime(fd, initial=max(seconds, 1e-6))

            self._set = _set_native
            return
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fd = libc.timerfd_create(1, 0o4000 | 0o2000000)  # CLOCK_MONOTONIC, NONBLOCK|CLOEXEC
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self.fd = fd
        self._closer = weakref.finalize(self, os.close, fd)
        settime = libc.timerfd_settime
        spec = (ctypes.c_long * 4)()

        def _set(seconds: float, absolute: bool) -> None:
            ns = int(seconds * 1e9) if absolute else max(int(seconds * 1e9), 1000)
            spec[0] = spec[1] = 0
            spec[2], spec[3] = divmod(max(ns, 1), 1_000_000_000)
            if settime(self.fd, int(absolute), ctypes.byref(spec), None) != 0:  # 1: ABSTIME
                raise OSError(ctypes.get_errno(), "timerfd_settime failed")

        self._set = _set

    def arm(self, seconds: float) -> None:
        """Fire in `seconds`; re-arming also resets a pending expiration count."""
        self._set(seconds, False)

    def arm_at(self, deadline: float) -> None:
        """Fire at `deadline` on time.monotonic's clock (CLOCK_MONOTONIC); a past one fires
        at once."""
        self._set(deadline, True)

    def drain(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass

    def close(self) -> None:
        self._closer()


_TIMERS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopTimer]" = (
    weakref.WeakKeyDictionary())


class LoopTimer:
    """Sleeps of one loop that end on one timerfd, armed at the earliest deadline."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._timer = TimerFd()
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = 0
        self._armed_at = float("inf")
        loop.add_reader(self._timer.fd, self._fire)

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> "LoopTimer | None":
        """The loop's timer, made on first use; None off Linux or where the loop cannot watch
        a file descriptor (then sleep on the loop's own timers)."""
        timer = _TIMERS.get(loop)
        if timer is None:
            if not sys.platform.startswith("linux"):
                return None
            try:
                timer = _TIMERS[loop] = cls(loop)
            except (OSError, NotImplementedError, AttributeError):
                return None
        return timer

    async def sleep_until(self, deadline: float) -> None:
        """Sleep until time.monotonic() reads `deadline`: one wake-up, at the deadline."""
        fut = self.loop.create_future()
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, fut))
        if deadline < self._armed_at:
            self._armed_at = deadline
            self._timer.arm_at(deadline)
        await fut  # a cancelled sleep stays in the heap until its deadline passes: harmless

    def _fire(self) -> None:
        self._timer.drain()
        heap = self._heap
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            fut = heapq.heappop(heap)[2]
            if not fut.done():
                fut.set_result(None)
        self._armed_at = heap[0][0] if heap else float("inf")
        if heap:
            self._timer.arm_at(self._armed_at)
