"""Forecast: when may a rank run another task first without delaying the task its hint names?

Greedy readiness is non-preemptive: a task that starts a moment before the hint's next task
becomes ready delays it by its whole duration, and that task is usually on the critical path
(docs/policy.md "Why greedy loses at the hint's own cap"). ReadySet therefore reserves the device
for the hint's next task and lets another ready task *backfill* only when this forecast says it
ends before the reserved task can start, the rule of EASY backfilling in batch schedulers.

What a rank knows, and all it uses:
- its own durations, as a running mean per (chunk, kind) kept across steps, scaled by the
  microbatch's cost factor when its activation carried one (a microbatch that was slow upstream
  is slow here too: multimodal batches);
- notices: a peer that starts the task feeding one of ours (the F upstream, the B downstream)
  says so with its expected duration less half a standard deviation (the early side), so the
  reserved task's arrival is predicted, not guessed;
- before any notice: the reserved task's feeder has not started, so its message cannot arrive
  before `now + the feeder's duration`.
A candidate must end by then with one standard deviation of its duration to spare (`margin`).
Without an estimate (the very first tasks) nothing backfills: the rank behaves as strict.
The forecast is advisory: a wrong one costs time, never correctness or liveness.

Note [no min/max]: these run several times per task, and a call of the builtin `min` or `max`
with two arguments costs ~0.25 us in CPython 3.11 (it builds an iterator over its arguments),
more than the rest of the arithmetic. The comparisons written out return the same values
(NaN included; tests/test_reservation.py compares them with the builtins' formulas).
"""

from __future__ import annotations

from typing import Callable

from .tasks import Kind, Task

__all__ = ["Forecast", "encode_duration", "decode_duration", "COST_UNIT"]

COST_UNIT = 1024
"""A microbatch's cost factor travels as an integer: factor * COST_UNIT (1024 = average)."""

MAX_FACTOR = 16.0
"""A microbatch is taken as at most this many times slower or faster than the mean."""
_MIN_FACTOR = 1 / MAX_FACTOR
_TICKS = 1e6  # a duration in a notice's tag: millionths of the clock's unit, saturating at 2^32
_MAX_TAG = 2**32 - 1


def encode_duration(seconds: float) -> int:
    """A duration in clock units as a notice's tag (millionths of a unit, saturated)."""
    ticks = int(seconds * _TICKS)  # Note [no min/max]
    return 0 if ticks < 0 else _MAX_TAG if ticks > _MAX_TAG else ticks


def decode_duration(tag: int) -> float:
    return tag / _TICKS


def _clamp(factor: float) -> float:
    """`min(MAX_FACTOR, max(1 / MAX_FACTOR, factor))` (Note [no min/max]; NaN gives the
    lower bound there too)."""
    if factor > MAX_FACTOR:
        return MAX_FACTOR
    return factor if factor >= _MIN_FACTOR else _MIN_FACTOR


class Forecast:
    """Duration estimates and notices of one rank; `fits(c, h)` is the backfill test."""

    __slots__ = ("_now", "_stats", "_feeder", "_expected", "_factor")

    def __init__(self) -> None:
        self._now: Callable[[], float] = lambda: 0.0
        # (chunk, kind) -> [sum, sum of squares, count, mean, standard deviation]: the mean and
        # deviation are derived once per observation, not at each of the many reads
        self._stats: dict[tuple[int, Kind], list[float]] = {}
        self._feeder: dict[tuple[int, Kind], float] = {}  # the last duration a feeder announced
        self._expected: dict[Task, float] = {}  # task -> when its message is expected
        self._factor: dict[int, float] = {}  # microbatch -> cost factor carried by messages

    def new_step(self, now: Callable[[], float]) -> None:
        """Forget the last step's notices and cost factors; keep the duration means."""
        self._now = now
        self._expected.clear()
        self._factor.clear()

    def mean(self, chunk: int, kind: Kind) -> float | None:
        stats = self._stats.get((chunk, kind))
        return None if stats is None else stats[3]

    def estimate(self, task: Task) -> float | None:
        """This rank's expected duration of `task`, or None before one of its kind ran."""
        stats = self._stats.get((task.chunk, task.kind))
        if stats is None:
            return None
        return stats[3] * self._factor.get(task.microbatch, 1.0)

    def early_estimate(self, task: Task) -> float | None:
        """The early side of `task`'s estimate, what a notice announces: the estimate less half
        its margin, at least 0 (the same value as from `estimate` and `margin`)."""
        stats = self._stats.get((task.chunk, task.kind))
        if stats is None:
            return None
        factor = self._factor.get(task.microbatch, 1.0)
        early = stats[3] * factor - stats[4] * factor / 2
        return early if early > 0.0 else 0.0  # max(0.0, early): Note [no min/max]

    def cost_factor(self, task: Task, duration: float) -> float:
        """How much slower than this rank's mean `task` ran (what its messages carry on)."""
        mean = self.mean(task.chunk, task.kind)
        if not mean or duration <= 0:
            return 1.0
        return _clamp(duration / mean)

    def observe(self, task: Task, duration: float) -> None:
        """A task of this rank ended after `duration` (clock units)."""
        self._record(task, duration)

    def _record(self, task: Task, duration: float) -> list[float]:
        key = (task.chunk, task.kind)
        x = duration / self._factor.get(task.microbatch, 1.0)
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = [0.0, 0.0, 0, 0.0, 0.0]
        stats[0] += x
        stats[1] += x * x
        stats[2] += 1
        n = stats[2]
        mean = stats[3] = stats[0] / n
        var = stats[1] / n - mean * mean
        stats[4] = var ** 0.5 if var > 0.0 else 0.0  # max(0.0, var) ** 0.5: Note [no min/max]
        return stats

    def forward_ended(self, task: Task, duration: float) -> float:
        """`observe`, then `carry` of the `cost_factor` it returns, with one look-up of the
        statistics: what a forward's end does on a rank with a forecast (the same floats as the
        three calls: carry's clamp leaves a clamped factor as it is)."""
        mean = self._record(task, duration)[3]
        factor = 1.0 if not mean or duration <= 0 else _clamp(duration / mean)
        self._factor[task.microbatch] = factor
        return factor

    def carry(self, microbatch: int, factor: float) -> None:
        """A message said how costly `microbatch` was upstream (clamped: it is a peer's word)."""
        self._factor[microbatch] = _clamp(factor)

    def carried(self, microbatch: int) -> float | None:
        """The cost factor `microbatch`'s activation carried here, None before one did
        (ready_set Note [light first])."""
        return self._factor.get(microbatch)

    def notice(self, task: Task, duration: float, at: float | None = None) -> None:
        """The feeder of our `task` started at `at` (None: now, when a notice is dated on
        reading) and takes about `duration`."""
        self._feeder[(task.chunk, task.kind)] = duration
        self._expected[task] = (self._now() if at is None else at) + duration

    def announced(self, task: Task, duration: float) -> None:
        """A notice for `task` read after its message: only the feeder's duration counts."""
        self._feeder[(task.chunk, task.kind)] = duration

    def arrived(self, task: Task) -> None:
        self._expected.pop(task, None)

    def margin(self, task: Task) -> float:
        """One standard deviation of `task`'s duration: a backfill must end in time with room
        for an ordinary overrun (jitter of 50 % is common), not just on average."""
        stats = self._stats.get((task.chunk, task.kind))
        if stats is None:
            return 0.0
        return stats[4] * self._factor.get(task.microbatch, 1.0)

    def earliest_arrival(self, task: Task) -> float | None:
        """When `task`'s message may arrive at the earliest: as announced, or, before any
        notice, one feeder duration from now (its feeder cannot have started yet)."""
        expected = self._expected.get(task)
        if expected is not None:
            return expected
        feeder = self._feeder.get((task.chunk, task.kind))
        if feeder is None:
            feeder = self.estimate(task)
            if feeder is None:
                return None
        return self._now() + feeder

    def clear_of_gradients(self, candidate: Task) -> bool:
        """Whether `candidate` (a W), started now, is predicted to end before every backward
        whose gradient was announced to this rank and has not arrived (ready_set Note
        [drain]). Without an estimate of its own it runs: nothing is known to wait for. A
        scan of the announced tasks: a handful at a time (one per peer feeding this rank)."""
        stats = self._stats.get((candidate.chunk, candidate.kind))
        if stats is None or not self._expected:
            return True
        end = self._now() + stats[3] * self._factor.get(candidate.microbatch, 1.0)
        for task, at in self._expected.items():
            if task.kind is Kind.B and at < end:
                return False
        return True

    def fits(self, candidate: Task, reserved: Task) -> bool:
        """Whether `candidate`, started now, is predicted to end (with its margin) before
        `reserved` (not ready: its message has not arrived) can start.

        A weight-gradient piece (W) also fits whenever no notice has come for `reserved`: its
        feeder has not started, so `reserved` is at least a feeder's duration away and usually
        much more (it waits in the peer's queue); and a W feeds no one, so the most it can cost
        is its own overrun on `reserved`, while keeping it for later costs its whole duration
        where the hint placed it. Measured (docs/policy.md "The rule today"): +2 to +6 % on the
        zero-bubble hints at their own caps, nothing lost elsewhere."""
        stats = self._stats.get((candidate.chunk, candidate.kind))
        if stats is None:
            return False
        if candidate.kind is Kind.W and reserved not in self._expected:
            return True
        arrival = self.earliest_arrival(reserved)
        if arrival is None:
            return False
        factor = self._factor.get(candidate.microbatch, 1.0)
        return self._now() + stats[3] * factor + stats[4] * factor <= arrival
