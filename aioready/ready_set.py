"""ReadySet: the tasks of one rank whose dependencies are met, ordered by hint rank.

Pure and loop-free, so the arbiter, the simulator and the property tests share it. Two heaps keyed
by hint rank: one for the F tasks of the rank's entry chunk (the only ones the gate may hold
back), one for everything else. A decision compares the two heap tops: O(log n), no scan. It is
the arbiter's `ReadyQueue` (arbiter.py; tests/test_ready_queue.py checks the conformance).

Note [entry-only gate]: the only task ever held back is the F of the entry chunk (chunk 0), and
only while `in_flight >= cap`. Gating F of deeper chunks, B or W deadlocks interleaved and V
placements (docs/hints.md "What deadlocks in interleaved and V placements if every F is capped");
gating only injection keeps `ready` mode deadlock-free (docs/architecture.md "The arbiter",
docs/hints.md "Why ready mode cannot deadlock"). In-flight counting is in_flight.InFlight: from
the start of a microbatch's entry F to the end of its last local backward piece.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Mapping, Sequence

from .errors import ConfigError
from .in_flight import InFlight, is_entry
from .tasks import Task

__all__ = ["ReadySet", "ReadySetStatistics", "InFlightReport"]


@dataclass(frozen=True, slots=True)
class ReadySetStatistics:
    num_ready: int
    num_gated: int
    in_flight: int
    peak_in_flight: int
    cap: int


class InFlightReport:
    """What a ready queue reports of its in-flight count (gate, stall dumps, metrics), read from
    its `flight` (an InFlight) and `_cap`: ReadySet and a tensor-parallel follower share it."""

    __slots__ = ()
    flight: InFlight
    _cap: int

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


class ReadySet(InFlightReport):
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
        heap = self._entry if is_entry(task) else self._main
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
        if is_entry(task):
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
            sum(1 for t in self._ready if is_entry(t))
            if self._strict else len(self._entry))
        return ReadySetStatistics(len(self), gated, self.flight.count, self.flight.peak,
                                  self._cap)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<ReadySet {'strict' if self._strict else 'ready'} ready={s.num_ready} "
                f"gated={s.num_gated} in_flight={s.in_flight}/{s.cap}>")
