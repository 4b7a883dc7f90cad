"""ReadySet: the tasks of one rank whose dependencies are met, ordered by hint rank.

Pure and loop-free, so the arbiter, the simulator and the property tests share it. Two heaps keyed
by hint rank: one for the F tasks of the rank's entry chunk (the only ones the gate may hold
back), one for everything else. A decision compares the two heap tops: O(log n), no scan. It is
the arbiter's `ReadyQueue` (arbiter.py; tests/test_ready_queue.py checks the conformance).

Note [entry-only gate]: the only task ever held back is the F of the entry chunk (chunk 0), and
only while `in_flight >= cap`. Gating F of deeper chunks, B or W deadlocks interleaved and V
placements (SCHEDULES.md 4.1 D5); gating only injection keeps `ready` mode deadlock-free
(DESIGN.md "The arbiter", SCHEDULES.md 4.3). In-flight counts a microbatch from the start of its
entry F to the end of its last local backward piece.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Mapping, Sequence

from .errors import ConfigError, InternalError
from .tasks import Kind, Task

__all__ = ["ReadySet", "ReadySetStatistics", "InFlight"]


@dataclass(frozen=True, slots=True)
class ReadySetStatistics:
    num_ready: int
    num_gated: int
    in_flight: int
    peak_in_flight: int
    cap: int


class InFlight:
    """The microbatches a rank holds: admitted at the start of their entry F, released when
    their last local backward piece (one per chunk: B unsplit, W split) has ended."""

    __slots__ = ("_left", "_pieces", "_last_kind", "count", "peak")

    def __init__(self, num_chunks: int, split_backward: bool) -> None:
        self._left: dict[int, int] = {}
        self._pieces = num_chunks
        self._last_kind = Kind.W if split_backward else Kind.B
        self.count = 0
        self.peak = 0

    def fresh(self) -> "InFlight":
        """An empty count under the same rule (a tensor-parallel member mirrors its leader)."""
        return InFlight(self._pieces, self._last_kind is Kind.W)

    def admit(self, microbatch: int) -> None:
        self._left[microbatch] = self._pieces
        self.count += 1
        if self.count > self.peak:
            self.peak = self.count

    def release(self, task: Task) -> None:
        """Bookkeeping after `task` ran: a microbatch leaves when its last backward piece ends."""
        if task.kind is not self._last_kind:
            return
        left = self._left.get(task.microbatch)
        if left is None:
            raise InternalError("backward piece of a microbatch that was never admitted",
                                task=task)
        if left == 1:
            del self._left[task.microbatch]
            self.count -= 1
        else:
            self._left[task.microbatch] = left - 1

    @property
    def microbatches(self) -> list[int]:
        return sorted(self._left)


class ReadySet:
    """Ready tasks of one rank; `ready` mode pops the best admissible, `strict` the next in order."""

    __slots__ = ("_priority", "_main", "_entry", "_cap", "flight", "_order", "_pos", "_ready",
                 "_strict")

    def __init__(
        self,
        priority: Mapping[Task, int],
        *,
        cap: int,
        num_chunks: int,
        split_backward: bool,
        strict_order: Sequence[Task] | None = None,
    ) -> None:
        if cap < 1:
            raise ConfigError("cap must admit at least one microbatch", expected=">= 1", got=cap)
        self._priority = priority
        self._cap = cap
        self._main: list[tuple[int, Task]] = []
        self._entry: list[tuple[int, Task]] = []
        self.flight = InFlight(num_chunks, split_backward)
        self._strict = strict_order is not None
        self._order: Sequence[Task] = strict_order or ()
        self._pos = 0
        self._ready: set[Task] = set()

    def push(self, task: Task) -> None:
        """Mark `task` ready: its local predecessor is done and its message has arrived."""
        if self._strict:
            self._ready.add(task)
            return
        heap = self._entry if task.kind is Kind.F and task.chunk == 0 else self._main
        heapq.heappush(heap, (self._priority[task], task))

    def pop_nowait(self) -> Task | None:
        """The task to run now, or None if nothing admissible is ready."""
        if self._strict:
            return self._pop_strict()
        main, entry = self._main, self._entry
        if entry and self.flight.count < self._cap and (not main or entry[0][0] < main[0][0]):
            task = heapq.heappop(entry)[1]
            self.flight.admit(task.microbatch)
            return task
        if main:
            return heapq.heappop(main)[1]
        return None

    def _pop_strict(self) -> Task | None:
        if self._pos >= len(self._order):
            return None
        task = self._order[self._pos]
        if task not in self._ready:
            return None
        if task.kind is Kind.F and task.chunk == 0:
            if self.flight.count >= self._cap:
                return None
            self.flight.admit(task.microbatch)
        self._ready.remove(task)
        self._pos += 1
        return task

    def done(self, task: Task) -> None:
        """Bookkeeping after `task` ran (see InFlight.release)."""
        self.flight.release(task)

    @property
    def in_flight(self) -> int:
        return self.flight.count

    @property
    def in_flight_microbatches(self) -> list[int]:
        """The admitted microbatches whose last backward piece has not ended (for dumps)."""
        return self.flight.microbatches

    @property
    def peak_in_flight(self) -> int:
        return self.flight.peak

    @property
    def cap(self) -> int:
        return self._cap

    @property
    def next_in_order(self) -> Task | None:
        """In strict mode, the task the order names next (for stall dumps)."""
        return self._order[self._pos] if self._strict and self._pos < len(self._order) else None

    def ready_tasks(self) -> list[Task]:
        """The ready tasks, best first (for stall dumps and tests; O(n log n))."""
        if self._strict:
            return sorted(self._ready, key=self._priority.__getitem__)
        return [t for _, t in sorted(self._main + self._entry)]

    def __len__(self) -> int:
        return len(self._ready) if self._strict else len(self._main) + len(self._entry)

    def statistics(self) -> ReadySetStatistics:
        gated = 0 if self.flight.count < self._cap else (
            sum(1 for t in self._ready if t.kind is Kind.F and t.chunk == 0)
            if self._strict else len(self._entry))
        return ReadySetStatistics(len(self), gated, self.flight.count, self.flight.peak,
                                  self._cap)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<ReadySet {'strict' if self._strict else 'ready'} ready={s.num_ready} "
                f"gated={s.num_gated} in_flight={s.in_flight}/{s.cap}>")
