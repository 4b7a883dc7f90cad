"""Spans: one record per task, and the report of a step that holds them.

Spans are plain tuples appended by the runtime (one append per task: negligible cost, measured in
bench/telemetry.py). Metrics are computed from them after the step (telemetry/metrics.py). Spans
flatten to a float64 array (`spans_to_array`) so they can cross processes as numbers
(telemetry/gather.py), never as pickles. This module imports neither torch nor mpi4py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ..tasks import Kind

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Span", "StepReport", "merge_reports", "spans_to_array", "spans_from_array",
           "SPAN_COLUMNS"]


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
    peak_activation_bytes: dict[int, int] = field(default_factory=dict)
    """per rank: most activation bytes held at once (measured, runtime/stage.py; modelled in
    the simulator); absent where nothing measures them (stage-less runs)"""
    costs: tuple[float, ...] | None = None
    """each microbatch's known cost (its size), where a hint="auto" pipeline may choose the
    microbatch order: then the spans number microbatches in the caller's order, not by slot
    (runtime/auto_order.py); None elsewhere"""
    activation_bytes: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    """per (stage, microbatch), measured on real stages only: (the bytes its F kept for backward,
    the bytes of its rank's entry input), what hint="auto" under memory= replays in simulation
    (sim/memory.py); empty in the simulator, which models them"""

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


def merge_reports(reports: list[StepReport]) -> StepReport:
    """One report of a step from the reports of its ranks (in one process)."""
    merged = StepReport(reports[0].step, num_ranks=reports[0].num_ranks)
    merged.start = min(r.start for r in reports)
    merged.end = max(r.end for r in reports)
    for r in reports:
        merged.spans.extend(r.spans)
        merged.peak_in_flight.update(r.peak_in_flight)
        merged.peak_activation_bytes.update(r.peak_activation_bytes)
        merged.activation_bytes.update(r.activation_bytes)
    return merged


SPAN_COLUMNS = ("step", "rank", "stage", "chunk", "microbatch", "kind", "ready", "start", "end")


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
