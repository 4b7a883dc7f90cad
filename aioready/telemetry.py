"""Telemetry: a span per task and the metrics of a step.

Spans are plain tuples appended by the runtime (one append per task: negligible cost, measured in
bench/telemetry.py). Metrics (step time, busy and bubble fractions, lower bound, efficiency,
activations in flight) are computed from them on demand, after the step, so recording stays cheap.
Spans flatten to a float64 array (`spans_to_array`) so they can cross processes as numbers
(aioready/gather.py), never as pickles. Exports live in aioready/export.py, optional live hooks in
aioready/instruments.py. This module imports neither torch nor mpi4py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from .tasks import Kind

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Span", "StepReport", "StepMetrics", "step_metrics", "peak_in_flight",
           "spans_to_array", "spans_from_array", "SPAN_COLUMNS", "SpanPlacement"]


class Span(NamedTuple):
    """One task's life on one rank; times in seconds of the loop clock."""

    rank: int
    stage: int
    chunk: int
    microbatch: int
    kind: Kind
    ready: float
    start: float
    end: float

    @property
    def label(self) -> str:
        return f"{self.kind.name}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


@dataclass(slots=True)
class StepReport:
    """What one step did: its spans, and its start and end on the loop clock."""

    step: int
    spans: list[Span] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    num_ranks: int = 1
    peak_in_flight: dict[int, int] = field(default_factory=dict)

    @property
    def step_time(self) -> float:
        return self.end - self.start

    def busy(self, rank: int) -> float:
        return sum(s.end - s.start for s in self.spans if s.rank == rank)

    def busy_fraction(self) -> list[float]:
        t = self.step_time or 1.0
        return [self.busy(r) / t for r in range(self.num_ranks)]

    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time in this step."""
        fr = self.busy_fraction()
        return 1.0 - sum(fr) / len(fr) if fr else 0.0

    def order(self, rank: int) -> list[str]:
        """The task order rank `rank` ran, as text."""
        return [s.label for s in sorted(self.spans, key=lambda s: s.start) if s.rank == rank]


SPAN_COLUMNS = ("step", "rank", "stage", "chunk", "microbatch", "kind", "ready", "start", "end")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepMetrics:
    """The numbers of one step; times in the loop clock's unit (seconds on a real loop)."""

    step: int
    step_time: float
    busy_fraction: tuple[float, ...]
    """Per rank: time its device ran tasks / step time."""
    bubble_fraction: float
    """Idle share of all ranks' time: 1 - mean busy fraction."""
    lower_bound: float
    """DESIGN.md's bound from the realized durations (aioready.sim.lower_bound)."""
    efficiency: float
    """lower_bound / step_time (1.0: no schedule could have been faster)."""
    peak_in_flight: tuple[int, ...]
    """Per rank: most microbatches holding activations at once, measured from the spans."""
    num_tasks: int

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "step_time": self.step_time,
                "busy_fraction": list(self.busy_fraction),
                "bubble_fraction": self.bubble_fraction, "lower_bound": self.lower_bound,
                "efficiency": self.efficiency, "peak_in_flight": list(self.peak_in_flight),
                "num_tasks": self.num_tasks}


class SpanPlacement:
    """The stage-to-rank map seen in a step's spans (all `lower_bound` needs from a Placement)."""

    def __init__(self, spans: Sequence[Span], num_ranks: int) -> None:
        self.num_ranks = num_ranks
        held: list[set[int]] = [set() for _ in range(num_ranks)]
        for s in spans:
            held[s.rank].add(s.stage)
        self._stages = [tuple(sorted(h)) for h in held]
        self.num_stages = 1 + max((s.stage for s in spans), default=-1)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return self._stages[rank] or (0,)


def peak_in_flight(spans: Sequence[Span], rank: int) -> int:
    """Most microbatches in flight on `rank` at once: from its entry F's start to the end of its
    last local backward piece (W when split, else B) on the entry chunk."""
    mine = [s for s in spans if s.rank == rank and s.chunk == 0]
    last = Kind.W if any(s.kind is Kind.W for s in mine) else Kind.B
    events = [(s.start, 1) for s in mine if s.kind is Kind.F]
    events += [(s.end, -1) for s in mine if s.kind is last]
    peak = cur = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        cur += delta
        peak = max(peak, cur)
    return peak


def step_metrics(report: StepReport) -> StepMetrics:
    """Metrics of one (merged) step report; the lower bound uses the spans' own durations."""
    spans = report.spans
    if not spans:
        raise ValueError(f"step {report.step} has no spans: nothing to measure")
    durations = {(s.stage, s.microbatch, int(s.kind)): s.end - s.start for s in spans}
    placement = SpanPlacement(spans, report.num_ranks)
    num_mb = 1 + max(s.microbatch for s in spans)
    split = any(s.kind is Kind.W for s in spans)
    from .sim import lower_bound  # lazily: sim imports this module
    lb = lower_bound(placement, num_mb, split,  # type: ignore[arg-type]
                     lambda st, m, k: durations.get((st, m, int(k)), 0.0))
    busy = tuple(report.busy_fraction())
    t = report.step_time
    peaks = tuple(peak_in_flight(spans, r) for r in range(report.num_ranks))
    return StepMetrics(step=report.step, step_time=t, busy_fraction=busy,
                       bubble_fraction=report.bubble_fraction(), lower_bound=lb,
                       efficiency=lb / t if t > 0 else 1.0, peak_in_flight=peaks,
                       num_tasks=len(spans))


def spans_to_array(report: StepReport) -> "np.ndarray":
    """The report's spans as an (n, 9) float64 array with SPAN_COLUMNS (exact for ints < 2**53)."""
    import numpy as np
    rows = [(report.step, s.rank, s.stage, s.chunk, s.microbatch, int(s.kind), s.ready, s.start,
             s.end) for s in report.spans]
    return np.array(rows, dtype=np.float64).reshape(len(rows), len(SPAN_COLUMNS))


def spans_from_array(array: "np.ndarray") -> list[tuple[int, Span]]:
    """Inverse of spans_to_array, over any number of steps: (step, span) pairs."""
    out = []
    for row in array.tolist():
        step, rank, stage, chunk, mb, kind = (int(v) for v in row[:6])
        out.append((step, Span(rank, stage, chunk, mb, Kind(kind), row[6], row[7], row[8])))
    return out
