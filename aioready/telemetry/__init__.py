"""Telemetry: what a step did, measured, exported and watched live.

`spans` (a record per task and the step report), `metrics` (step time, bubbles, efficiency),
`bounds` (the lower bound of a step), `instruments` (optional hooks), `export` (Chrome trace,
CSV, Parquet), `plots` (PNG timelines), `prometheus` (a live endpoint), `gather` (every rank's
reports to one rank over MPI). This package imports neither torch nor mpi4py; plots and prometheus load
their extras on use.
"""

from __future__ import annotations

from .metrics import StepMetrics, peak_in_flight, step_metrics
from .spans import SPAN_COLUMNS, Span, StepReport, spans_from_array, spans_to_array

__all__ = ["Span", "StepReport", "StepMetrics", "step_metrics", "peak_in_flight",
           "spans_to_array", "spans_from_array", "SPAN_COLUMNS"]
