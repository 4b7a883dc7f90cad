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

On a linear placement (stage r on rank r) a second bound adds the cool-down: the last backward
B(r, m) that rank r runs ends no earlier than `now + d + fb(r)` (fb: its F and B work not yet
started), and after it the chain B(r-1, m), ..., B(0, m), W(0, m) must still run, one after the
other. The chain is the shortest among the microbatches whose B on rank r has not started.

The step time of a stopped candidate is unknown; only "more than the bound" is. The tuner's
table says so.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from typing import Callable

import numpy as np

from ..devices.base import TaskInfo
from ..errors import AioreadyError
from ..hints import HintOrder
from ..tasks import Kind
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
        busiest = [max(w) for w in self.work]
        self.later = [sum(busiest[step + 1:]) for step in range(steps)]  # the steps after
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
        self.chains: list[list[list[tuple[float, int]]]] | None = None
        if place.num_chunks == 1:  # stage r on rank r
            tables = [durations.table(step) for step in range(steps)]
            self.fb_work = [[float(t[r, :, Kind.F].sum() + t[r, :, Kind.B].sum())
                             for r in range(hint.num_ranks)] for t in tables]
            self.chains = [self._chains(t, hint.split_backward) for t in tables]

    @staticmethod
    def _chains(table: np.ndarray, split: bool) -> list[list[tuple[float, int]]]:
        """Per rank r, (the backward chain after B(r, m) to the step's end, m), as a heap."""
        below = np.cumsum(table[:, :, Kind.B], axis=0) - table[:, :, Kind.B]  # sum over s < r
        last = table[0, :, Kind.W] if split else np.zeros(table.shape[1])
        out = []
        for r in range(table.shape[0]):
            heap = [(float(below[r, m] + last[m]), m) for m in range(table.shape[1])]
            heapq.heapify(heap)
            out.append(heap)
        return out

    def begin_step(self, step: int, start: float, done: float) -> None:
        self.step, self.step_start, self.done = step, start, done
        self.rest = list(self.work[step])
        if self.chains is not None:
            self.rest_fb = list(self.fb_work[step])
            self.heaps = [list(h) for h in self.chains[step]]
            self.tail = [dict((m, t) for t, m in h) for h in self.chains[step]]
            self.b_started: list[set[int]] = [set() for _ in self.heaps]

    def started(self, info: TaskInfo, duration: float) -> None:
        """A task of `duration` starts now on `info.rank`; cancel the run if the bound passed."""
        if info.step != self.step or self.stopped:
            return
        rest = self.rest[info.rank] - duration
        self.rest[info.rank] = rest
        end = self.now() + duration + rest
        if self.chains is not None:
            end = max(end, self._cool_down(info, duration))
        at_least = self.done + (end - self.step_start) + self.later[self.step]
        if at_least > self.limit * (1 + 1e-9) + 1e-9:  # sums round: a tie must run on
            self.stopped = True
            self.at_least = at_least / self.steps
            if self.task is not None:
                self.task.cancel()

    def _cool_down(self, info: TaskInfo, duration: float) -> float:
        r, kind = info.rank, info.kind
        if kind is not Kind.W:
            self.rest_fb[r] -= duration
        started = self.b_started[r]
        current = math.inf
        if kind is Kind.B:
            started.add(info.microbatch)
            current = self.tail[r][info.microbatch]
        heap = self.heaps[r]
        while heap and heap[0][1] in started:
            heapq.heappop(heap)
        chain = min(current, heap[0][0] if heap else math.inf)
        if chain == math.inf:
            return 0.0  # every B of this rank ran: the chain bound no longer applies
        return self.now() + duration + self.rest_fb[r] + chain

    def wrap(self, duration: Callable[[TaskInfo], float]) -> Callable[[TaskInfo], float]:
        def watched(info: TaskInfo) -> float:
            d = duration(info)
            self.started(info, d)
            return d
        return watched
