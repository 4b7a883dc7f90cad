"""Stopping a simulation once it cannot beat a given step time (what makes hint="auto" fast).

The tuner (sim/choice.py) simulates many candidate schedules on the same durations and keeps
the fastest. A candidate only has to be simulated to the end if it might win, so the simulator
may stop one as soon as its mean step time is known to exceed the best found so far.

"Known" is a lower bound that only grows, so stopping never drops a candidate that could have
won: the answer is the one the full search gives (tests/test_autotune.py compares both). A rank
runs one task at a time, so when rank r starts a task at time `now`, the step cannot end before
`now + d + rest(r)`, where d is that task's duration and rest(r) the durations of the rank's
tasks of the step not yet started. Idle time is counted as it happens: it pushes `now` later.
A rank's work is known exactly (the durations are the tuner's input), so the bound is checked
on every task start at the cost of a subtraction and a comparison. Over several steps the bound
is the finished steps' times, this step's bound, and each later step's busiest rank's work.

The step time of a stopped candidate is unknown; only "more than the bound" is. The tuner's
table says so.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from ..devices.base import TaskInfo
from ..errors import AioreadyError
from ..hints import HintOrder
from .durations import Durations

__all__ = ["Cutoff", "Exceeded"]


class Exceeded(AioreadyError):
    """A simulation stopped because its mean step time exceeds `bound` (at least `at_least`)."""

    def __init__(self, bound: float, at_least: float) -> None:
        super().__init__(f"the mean step time exceeds {bound:.6g} ms (at least {at_least:.6g})")
        self.bound = bound
        self.at_least = at_least


class Cutoff:
    """Watches every task start of a simulation and cancels the run when the mean step time
    is bound to exceed `bound` (strictly: a tie runs to the end, the tuner breaks ties)."""

    def __init__(self, hint: HintOrder, durations: Durations, steps: int, bound: float) -> None:
        place = hint.placement
        kinds = {rank: [(place.stage_of(rank, t.chunk), t.microbatch, t.kind)
                        for t in hint.strict_order(rank)] for rank in range(hint.num_ranks)}
        self.work = [[sum(durations.ms(step, s, m, k) for s, m, k in kinds[rank])
                      for rank in range(hint.num_ranks)] for step in range(steps)]
        self.steps = steps
        self.limit = bound * steps
        self.bound = bound
        self.rest: list[float] = []
        self.step = -1
        self.step_start = 0.0
        self.done = 0.0  # the finished steps' step times
        self.at_least = 0.0
        self.stopped = False
        self.task: asyncio.Task[None] | None = None
        self.now: Callable[[], float] = lambda: 0.0

    def begin_step(self, step: int, start: float, done: float) -> None:
        self.step, self.step_start, self.done = step, start, done
        self.rest = list(self.work[step])

    def started(self, info: TaskInfo, duration: float) -> None:
        """A task of `duration` starts now on `info.rank`; cancel the run if the bound passed."""
        if info.step != self.step or self.stopped:
            return
        rest = self.rest[info.rank] - duration
        self.rest[info.rank] = rest
        end = self.now() + duration + rest
        later = sum(max(w) for w in self.work[self.step + 1:])
        at_least = self.done + (end - self.step_start) + later
        if at_least > self.limit * (1 + 1e-9) + 1e-9:  # sums round: a tie must run on
            self.stopped = True
            self.at_least = at_least / self.steps
            if self.task is not None:
                self.task.cancel()

    def wrap(self, duration: Callable[[TaskInfo], float]) -> Callable[[TaskInfo], float]:
        def watched(info: TaskInfo) -> float:
            d = duration(info)
            self.started(info, d)
            return d
        return watched
