"""InFlight: the one rule that counts the microbatches a rank holds.

A microbatch is admitted when the rank's entry-stage F (chunk 0) starts and leaves when its last
local backward piece ends: one piece per chunk the rank holds, B with an unsplit backward, W with
a split one. The same class counts live in the arbiter (ready_set.ReadySet, whose gate holds back
only that entry F), walks a hint's order for its peak and default cap (hints.py), and replays a
step's spans (telemetry/metrics.py), so the three agree by construction.

A replay treats ties by the rank's own execution order: a rank runs one task at a time, so a
piece that ends at t is released before an F that starts at t admits (the arbiter applies a
task's end before its next decision), while a zero-length F admits before its own end.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .errors import InternalError
from .tasks import Kind, Task

__all__ = ["InFlight", "is_entry", "peak_in_flight", "peak_of_timeline"]


def is_entry(task: Task) -> bool:
    """The task that admits a microbatch: F of the rank's entry chunk (chunk 0)."""
    return task.kind is Kind.F and task.chunk == 0


class InFlight:
    """The microbatches a rank holds: admitted at the start of their entry F, released when
    their last local backward piece (one per chunk: B unsplit, W split) has ended.

    `lenient` is for replays of orders and spans that need not be valid sequences (a ranking
    used as a ready-mode hint may list a B before its F): a piece of a microbatch that was never
    admitted is ignored there, while the live count treats it as a bug.
    """

    __slots__ = ("_left", "_pieces", "_last_kind", "_lenient", "count", "peak")

    def __init__(self, num_chunks: int, split_backward: bool, *, lenient: bool = False) -> None:
        self._left: dict[int, int] = {}
        self._pieces = num_chunks
        self._last_kind = Kind.W if split_backward else Kind.B
        self._lenient = lenient
        self.count = 0
        self.peak = 0

    def fresh(self) -> "InFlight":
        """An empty count under the same rule (a tensor-parallel member mirrors its leader)."""
        return InFlight(self._pieces, self._last_kind is Kind.W, lenient=self._lenient)

    def admit(self, microbatch: int) -> None:
        self._left[microbatch] = self._pieces
        self.count += 1
        if self.count > self.peak:
            self.peak = self.count

    def start(self, task: Task) -> None:
        """Bookkeeping as `task` starts: an entry F admits its microbatch."""
        if is_entry(task):
            self.admit(task.microbatch)

    def release(self, task: Task) -> None:
        """Bookkeeping after `task` ran: a microbatch leaves when its last backward piece ends."""
        if task.kind is not self._last_kind:
            return
        left = self._left.get(task.microbatch)
        if left is None:
            if self._lenient:
                return
            raise InternalError("backward piece of a microbatch that was never admitted",
                                task=task)
        if left == 1:
            del self._left[task.microbatch]
            self.count -= 1
        else:
            self._left[task.microbatch] = left - 1

    def holds(self, microbatch: int) -> bool:
        return microbatch in self._left

    @property
    def microbatches(self) -> list[int]:
        return sorted(self._left)


def peak_in_flight(order: Sequence[Task], *, num_chunks: int, split_backward: bool) -> int:
    """Peak of a rank that runs `order` in sequence, each task starting after the last ended."""
    flight = InFlight(num_chunks, split_backward, lenient=True)
    for task in order:
        flight.start(task)
        flight.release(task)
    return flight.peak


def peak_of_timeline(runs: Iterable[tuple[Task, float, float]], *, num_chunks: int,
                     split_backward: bool) -> int:
    """Peak of a rank whose tasks ran as given: (task, start, end) in execution order.

    Events are replayed sorted by time: admits at an entry F's start, releases at a backward
    piece's end; ties follow the execution order (see the module's note).
    """
    events: list[tuple[float, int, int, Task]] = []
    for position, (task, start, end) in enumerate(runs):
        if is_entry(task):
            events.append((start, position, 0, task))
        events.append((end, position, 1, task))
    events.sort(key=lambda e: e[:3])
    flight = InFlight(num_chunks, split_backward, lenient=True)
    for _, _, is_end, task in events:
        if is_end:
            flight.release(task)
        else:
            flight.admit(task.microbatch)
    return flight.peak
