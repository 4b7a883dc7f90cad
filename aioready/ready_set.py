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

Note [byte gate]: with a byte budget (`held`, a held_bytes.HeldBytes with a budget) the entry F
is held back by bytes instead of by count: it is admitted when nothing is in flight (liveness: a
microbatch larger than the budget still runs, alone) or when the bytes held plus its predicted
bytes fit the budget. Under the reservation the hint's own next entry F is never held (the order
alone must always go on, as with a count cap at or above the hint's peak), and one admitted
ahead of the order must also fit the byte room above what the order holds at its peak.

Note [light first]: with `lightness` (the `light` policy, docs/policy.md "Light first"), a
forward of the entry chunk whose microbatch's carried cost factor is below OVERTAKE times that of
the best-ranked one runs first. A microbatch that is slow on every stage (multimodal) otherwise
leads a convoy: each stage runs forwards in microbatch order, so the light ones behind it wait
for it on every stage. Only microbatches whose factor arrived with their activation take part
(not the first stage's, whose cost nobody knows yet). A third heap keyed by (factor, rank)
keeps the decision O(log n); the choice is among admissible ready tasks, so greedy's liveness
argument holds unchanged.

Note [drain]: with `drain` (the `drain` policy, docs/policy.md "The drain policy"), the rank is
greedy until it has admitted all `entries` entry forwards of the step. From then on (the drain)
a ready backward or forward runs before any weight gradient W, and a W runs only if `drain(w)`
says it ends before every gradient announced to this rank (forecast.py `clear_of_gradients`):
a W that starts just before a gradient arrives delays that backward, and with it the gradient's
whole way back to stage 0. The W heap is a third heap, so a decision stays O(log n). A refused W
waits only for an announced message, whose sender has started the task that sends it, so it
arrives; once it has, it no longer holds W back: greedy's liveness argument holds.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from .errors import ConfigError
from .held_bytes import HeldBytes
from .in_flight import InFlight, is_entry
from .tasks import Kind, Task

__all__ = ["ReadySet", "ReadySetStatistics", "InFlightReport", "Fits", "OVERTAKE"]

Fits = Callable[[Task, Task], bool]
"""`fits(candidate, reserved)`: may `candidate` run now without delaying `reserved`
(forecast.py)."""

OVERTAKE = 2 / 3
"""Note [light first]: a forward overtakes the best-ranked one when its microbatch costs less
than this fraction of it: clearly lighter, not within the noise of two ordinary ones."""


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
    """Ready tasks of one rank; `ready` mode pops the best admissible, `strict` the next in order.

    With `fits` (ready mode, forecast.py), the hint's next task not yet started holds a
    reservation: it runs as soon as it is ready, and before that another ready task runs only if
    `fits(task, reserved)` says it ends in time (Note [reservation]).
    """

    __slots__ = ("_priority", "_main", "_entry", "_cap", "flight", "_order", "_pos", "_ready",
                 "_strict", "_fits", "_taken", "_ahead", "_room", "_held", "_light", "_factor",
                 "_unheaped", "_drain", "_wheap", "_entries")

    def __init__(
        self,
        priority: Mapping[Task, int],
        *,
        cap: int,
        num_chunks: int,
        split_backward: bool,
        strict_order: Sequence[Task] | None = None,
        reserve_order: Sequence[Task] | None = None,
        reserve_peak: int = 0,
        fits: Fits | None = None,
        held: HeldBytes | None = None,
        lightness: Callable[[int], float | None] | None = None,
        drain: Callable[[Task], bool] | None = None,
        entries: int = 0,
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
        # Note [reservation]: only when the hint's order fits the cap, so that the order alone
        # can always go on (below its peak the greedy rule and its liveness proof apply).
        reserving = (not self._strict and fits is not None and reserve_order is not None
                     and cap >= reserve_peak)
        self._fits = fits if reserving else None
        if reserving:
            self._order = reserve_order  # type: ignore[assignment]
        self._taken: set[Task] = set()
        self._ahead: set[int] = set()  # microbatches admitted ahead of the order, still held
        self._room = cap - reserve_peak  # how many may be held ahead of it
        # Note [byte gate]: the ledger is the runtime's to write; here it is only asked
        self._held = held if held is not None and held.budget is not None else None
        # Note [light first]: microbatch -> carried cost factor (None: not known)
        self._factor = lightness if not self._strict and self._fits is None else None
        self._light: list[tuple[float, int, Task]] = []
        # Note [reservation]: pushed tasks wait here until `_best` needs the heaps; most run as
        # the reserved task first and never enter them (priorities are distinct, so the heap
        # tops are the same whenever they are filled)
        self._unheaped: list[Task] = []
        # Note [drain]: W waits in its own heap; `_entries` counts down the entry forwards
        self._drain = drain if not self._strict and self._fits is None else None
        self._wheap: list[tuple[int, Task]] = []
        self._entries = entries

    def _opens(self, task: Task) -> bool:
        """Whether the gate admits entry F `task` now (count, or Note [byte gate])."""
        if self._held is None:
            return self.flight.count < self._cap
        return self.flight.count == 0 or self._held.fits(task.microbatch)

    def push(self, task: Task) -> None:
        """Mark `task` ready: its local predecessor is done and its message has arrived."""
        self._ready.add(task)
        if self._strict:
            return
        if self._fits is not None:
            self._unheaped.append(task)
            return
        heap = self._entry if is_entry(task) else self._main
        if self._drain is not None and task.kind is Kind.W:
            heap = self._wheap
        heapq.heappush(heap, (self._priority[task], task))
        if self._factor is not None and heap is self._entry:
            factor = self._factor(task.microbatch)
            if factor is not None:
                heapq.heappush(self._light, (factor, self._priority[task], task))

    def pop_nowait(self) -> Task | None:
        """The task to run now, or None if nothing admissible is ready."""
        if self._strict:
            return self._pop_strict()
        if self._fits is not None:
            return self._pop_reserving()
        if self._drain is not None:
            return self._pop_drain()
        main, entry = self._main, self._entry
        if self._factor is not None:  # entries taken from the light heap are dropped lazily
            while entry and entry[0][1] not in self._ready:
                heapq.heappop(entry)
        if entry and self._opens(entry[0][1]) and (not main or entry[0][0] < main[0][0]):
            task = self._lighter(entry[0][1]) if self._light else None
            if task is None:
                task = heapq.heappop(entry)[1]
            self.flight.admit(task.microbatch)
        elif main:
            task = heapq.heappop(main)[1]
        else:
            return None
        self._ready.discard(task)
        return task

    def _pop_drain(self) -> Task | None:
        """Note [drain]: greedy over three heaps until every entry forward is admitted; then
        backwards and forwards first, and a W only where no announced gradient comes first."""
        main, entry, wheap = self._main, self._entry, self._wheap
        if self._entries > 0:
            best, top = None, None
            if entry and self._opens(entry[0][1]):
                best, top = entry, entry[0][0]
            if main and (top is None or main[0][0] < top):
                best, top = main, main[0][0]
            if wheap and (top is None or wheap[0][0] < top):
                best = wheap
            if best is None:
                return None
            task = heapq.heappop(best)[1]
            if best is entry:
                self.flight.admit(task.microbatch)
                self._entries -= 1
        elif main:
            task = heapq.heappop(main)[1]
        elif wheap and self._drain(wheap[0][1]):  # type: ignore[misc]
            task = heapq.heappop(wheap)[1]
        else:
            return None
        self._ready.discard(task)
        return task

    def _lighter(self, best: Task) -> Task | None:
        """Note [light first]: the lightest ready entry forward, taken off its heap, if it costs
        less than OVERTAKE times `best`; else None."""
        light, ready = self._light, self._ready
        while light and light[0][2] not in ready:
            heapq.heappop(light)
        if not light:
            return None
        factor, _, task = light[0]
        mine = self._factor(best.microbatch)  # type: ignore[misc]
        if mine is None or factor >= OVERTAKE * mine or not self._opens(task):
            return None
        heapq.heappop(light)
        return task

    def _pop_reserving(self) -> Task | None:
        reserved = self._reserved()
        gated = False
        if reserved is not None and reserved in self._ready:
            entry = reserved.kind is Kind.F and not reserved.chunk  # in_flight.is_entry
            if not entry or self.flight.count < self._cap:
                self._ready.discard(reserved)
                self._taken.add(reserved)
                self._pos += 1  # it is the order's first not started: _reserved's next step
                if entry:
                    self.flight.admit(reserved.microbatch)
                return reserved
            gated = True  # waits for a release: only a backward piece can bring it
        candidate = self._best()
        if candidate is None:
            return None
        if (reserved is None or gated or is_entry(candidate)
                or self._fits(candidate, reserved)):  # type: ignore[misc]
            self._take(candidate, ahead=True)
            return candidate
        return None

    def _reserved(self) -> Task | None:
        """The first task of the order not yet started (advancing past those that were)."""
        order, pos, taken = self._order, self._pos, self._taken
        while pos < len(order) and (order[pos] in taken):
            if self._ahead and is_entry(order[pos]):
                self._ahead.discard(order[pos].microbatch)
            pos += 1
        self._pos = pos
        return order[pos] if pos < len(order) else None

    def _best(self) -> Task | None:
        """The best-ranked admissible ready task (heap tops; started ones are dropped lazily)."""
        main, entry, taken = self._main, self._entry, self._taken
        if self._unheaped:
            priority = self._priority
            for task in self._unheaped:
                if task not in taken:
                    heapq.heappush(entry if is_entry(task) else main, (priority[task], task))
            self._unheaped.clear()
        while main and main[0][1] in taken:
            heapq.heappop(main)
        while entry and entry[0][1] in taken:
            heapq.heappop(entry)
        if not entry:
            admit = False
        elif self._held is None:
            admit = self.flight.count < self._cap and len(self._ahead) < self._room
        else:
            admit = self.flight.count == 0 or self._held.fits_ahead(entry[0][1].microbatch,
                                                                    self._ahead)
        if admit and (not main or entry[0][0] < main[0][0]):
            return entry[0][1]
        return main[0][1] if main else None

    def _take(self, task: Task, *, ahead: bool) -> None:
        self._ready.discard(task)
        self._taken.add(task)
        if is_entry(task):
            self.flight.admit(task.microbatch)
            if ahead:
                self._ahead.add(task.microbatch)

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
        if self._ahead and task.microbatch in self._ahead and not self.flight.holds(
                task.microbatch):
            self._ahead.discard(task.microbatch)

    @property
    def next_in_order(self) -> Task | None:
        """In strict mode, the task the order names next (for stall dumps)."""
        return self._order[self._pos] if self._strict and self._pos < len(self._order) else None

    @property
    def reserved(self) -> Task | None:
        """In ready mode with a reservation, the task that holds it (for stall dumps)."""
        return self._reserved() if self._fits is not None else None

    def ready_tasks(self) -> list[Task]:
        """The ready tasks, best first (for stall dumps and tests; O(n log n))."""
        return sorted(self._ready, key=self._priority.__getitem__)

    def __len__(self) -> int:
        return len(self._ready)

    def statistics(self) -> ReadySetStatistics:
        entries = [t for t in self._ready if is_entry(t)]
        if self._held is None:
            blocked = self.flight.count >= self._cap
        else:
            blocked = self.flight.count > 0 and not any(self._held.fits(t.microbatch)
                                                        for t in entries)
        gated = len(entries) if blocked else 0
        return ReadySetStatistics(len(self), gated, self.flight.count, self.flight.peak,
                                  self._cap)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<ReadySet {'strict' if self._strict else 'ready'} ready={s.num_ready} "
                f"gated={s.num_gated} in_flight={s.in_flight}/{s.cap}>")
