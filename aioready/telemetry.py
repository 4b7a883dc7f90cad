"""Telemetry: a span per task and the metrics of a step.

Spans are plain tuples appended by the runtime (one append per task: negligible cost). Metrics
(busy fraction, bubble fraction, lower bound, efficiency) are computed from them on demand.
This module imports neither torch nor mpi4py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .tasks import Kind

__all__ = ["Span", "StepReport"]


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
