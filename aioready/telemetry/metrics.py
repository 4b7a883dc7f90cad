"""The metrics of one step, computed from its spans after the step, so recording stays cheap.

Step time, busy and bubble fractions, lower bound, efficiency and activations in flight. The lower
bound uses the spans' own durations (telemetry/bounds.py), so a real run and a simulated one are
measured by the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..in_flight import peak_of_timeline
from ..tasks import Kind, Task
from .bounds import lower_bound
from .spans import Span, StepReport

__all__ = ["StepMetrics", "step_metrics", "peak_in_flight", "peak_activations", "SpanPlacement"]


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
    """docs/architecture.md "Lower bound" from the realized durations (telemetry/bounds.py)."""
    efficiency: float
    """lower_bound / step_time (1.0: no schedule could have been faster)."""
    peak_in_flight: tuple[int, ...]
    """Per rank: most microbatches in flight at once, replayed from the spans (in_flight.py)."""
    num_tasks: int
    peak_activation_bytes: tuple[int | None, ...] = ()
    """Per rank: most activation bytes held at once, as the runtime measured them (saved for
    backward, runtime/stage.py); None where nothing measured (stage-less runs)."""

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "step_time": self.step_time,
                "busy_fraction": list(self.busy_fraction),
                "bubble_fraction": self.bubble_fraction, "lower_bound": self.lower_bound,
                "efficiency": self.efficiency, "peak_in_flight": list(self.peak_in_flight),
                "num_tasks": self.num_tasks,
                "peak_activation_bytes": list(self.peak_activation_bytes)}


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
    """Most microbatches in flight on `rank` at once, by the arbiter's own rule (in_flight.py):
    from its entry F's start to the end of its last local backward piece on every chunk it holds.

    The rank's spans are replayed in execution order (start time; equal starts keep the report's
    order, which is the order they ran in), so ties resolve as they did live.
    """
    mine = sorted((s for s in spans if s.rank == rank), key=lambda s: (s.start, s.end))
    runs = [(Task(s.kind, s.microbatch, s.chunk), s.start, s.end) for s in mine]
    return peak_of_timeline(runs, num_chunks=1 + max((s.chunk for s in mine), default=0),
                            split_backward=any(s.kind is Kind.W for s in mine))


def peak_activations(spans: Sequence[Span], rank: int) -> int:
    """Most (chunk, microbatch) activations `rank` held at once: each from its F's start to the
    end of its last backward piece on that chunk (B unsplit, W split), replayed like
    `peak_in_flight` with each pair counted as a microbatch of one chunk."""
    mine = sorted((s for s in spans if s.rank == rank), key=lambda s: (s.start, s.end))
    chunks = 1 + max((s.chunk for s in mine), default=0)
    runs = [(Task(s.kind, s.microbatch * chunks + s.chunk), s.start, s.end) for s in mine]
    return peak_of_timeline(runs, num_chunks=1,
                            split_backward=any(s.kind is Kind.W for s in mine))


def step_metrics(report: StepReport) -> StepMetrics:
    """Metrics of one (merged) step report; the lower bound uses the spans' own durations."""
    spans = report.spans
    if not spans:
        raise ValueError(f"step {report.step} has no spans: nothing to measure")
    durations = {(s.stage, s.microbatch, int(s.kind)): s.end - s.start for s in spans}
    placement = SpanPlacement(spans, report.num_ranks)
    num_mb = 1 + max(s.microbatch for s in spans)
    split = any(s.kind is Kind.W for s in spans)
    lb = lower_bound(placement, num_mb, split,  # type: ignore[arg-type]
                     lambda st, m, k: durations.get((st, m, int(k)), 0.0))
    busy = tuple(report.busy_fraction())
    t = report.step_time
    peaks = tuple(peak_in_flight(spans, r) for r in range(report.num_ranks))
    return StepMetrics(step=report.step, step_time=t, busy_fraction=busy,
                       bubble_fraction=report.bubble_fraction(), lower_bound=lb,
                       efficiency=lb / t if t > 0 else 1.0, peak_in_flight=peaks,
                       num_tasks=len(spans), peak_activation_bytes=tuple(
                           report.peak_activation_bytes.get(r)
                           for r in range(report.num_ranks)))
