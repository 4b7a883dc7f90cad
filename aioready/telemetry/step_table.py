"""The per-step, per-rank table: one row per (step, rank), for BI tools and notebooks.

Where the span exports (export.py) hold one row per task, this holds what a dashboard or a
spreadsheet plots without code of ours: a rank's busy, waiting, gated and idle shares of the step
(telemetry/occupancy.py), its tasks, its sends, its peak in flight, and the step's time, lower
bound and efficiency repeated on each of its rows. Written as CSV or Parquet (by suffix); the
columns, their types and units are `STEP_TABLE_COLUMNS`, documented in docs/telemetry.md.
Times are seconds (`clock_unit_s` converts another clock).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Sequence

from ..errors import ConfigError
from ..tasks import Kind
from .metrics import step_metrics
from .occupancy import StepWindow, occupancy
from .spans import StepReport

__all__ = ["STEP_TABLE_COLUMNS", "step_table", "write_step_table"]

STEP_TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("step", "int", "step index"),
    ("rank", "int", "pipeline rank"),
    ("step_start_s", "float", "seconds from the first step's start to this step's start"),
    ("step_time_s", "float", "the step's time (all ranks)"),
    ("lower_bound_s", "float", "the step's lower bound (docs/architecture.md)"),
    ("efficiency", "float", "lower_bound_s / step_time_s"),
    ("busy_s", "float", "seconds the rank's device ran tasks"),
    ("busy_fraction", "float", "busy_s / step_time_s"),
    ("waiting_fraction", "float", "share of the step nothing was ready while tasks remained"),
    ("gated_fraction", "float", "share of the step a task was ready but held (cap, policy, strict)"),
    ("idle_fraction", "float", "the rest: 1 - busy - waiting - gated"),
    ("num_tasks", "int", "tasks the rank ran"),
    ("num_f", "int", "F tasks"),
    ("num_b", "int", "B tasks"),
    ("num_w", "int", "W tasks (split backward)"),
    ("messages_sent", "int", "activations and gradients sent to other ranks"),
    ("mean_wait_s", "float", "mean seconds from a task's ready to its start"),
    ("peak_in_flight", "int", "most microbatches in flight on the rank at once"),
)


def _sends(report: StepReport) -> dict[int, int]:
    rank_of = {s.stage: s.rank for s in report.spans}
    out: dict[int, int] = {}
    for s in report.spans:
        to = s.stage + 1 if s.kind is Kind.F else s.stage - 1 if s.kind is Kind.B else -1
        if to in rank_of and rank_of[to] != s.rank:
            out[s.rank] = out.get(s.rank, 0) + 1
    return out


def step_table(reports: Sequence[StepReport], *, clock_unit_s: float = 1.0
               ) -> list[dict[str, Any]]:
    """One dict per (step, rank) with STEP_TABLE_COLUMNS' keys."""
    if not reports:
        raise ConfigError("nothing to tabulate", expected="at least one step report", got=0)
    origin = min(r.start for r in reports)
    rows = []
    for rep in reports:
        m = step_metrics(rep)
        counts: dict[int, int] = {}
        for s in rep.spans:
            counts[s.rank] = counts.get(s.rank, 0) + 1
        occ = occupancy([StepWindow(rep.spans, rep.start, rep.end, counts)],
                        range(rep.num_ranks), rep.start, rep.end)
        sends = _sends(rep)
        for o in occ:
            mine = [s for s in rep.spans if s.rank == o.rank]
            busy = sum(s.end - s.start for s in mine)
            rows.append({
                "step": rep.step, "rank": o.rank,
                "step_start_s": (rep.start - origin) * clock_unit_s,
                "step_time_s": m.step_time * clock_unit_s,
                "lower_bound_s": m.lower_bound * clock_unit_s, "efficiency": m.efficiency,
                "busy_s": busy * clock_unit_s, "busy_fraction": o.busy,
                "waiting_fraction": o.waiting, "gated_fraction": o.gated,
                "idle_fraction": o.idle, "num_tasks": len(mine),
                **{f"num_{k.name.lower()}": sum(s.kind is k for s in mine) for k in Kind},
                "messages_sent": sends.get(o.rank, 0),
                "mean_wait_s": (sum(s.start - s.ready for s in mine) / len(mine)
                                * clock_unit_s if mine else 0.0),
                "peak_in_flight": m.peak_in_flight[o.rank]})
    return rows


def write_step_table(reports: Sequence[StepReport], path: str | Path, *,
                     clock_unit_s: float = 1.0) -> Path:
    """The table as .csv or .parquet (pyarrow), chosen by the suffix."""
    path = Path(path)
    rows = step_table(reports, clock_unit_s=clock_unit_s)
    names = [c for c, _, _ in STEP_TABLE_COLUMNS]
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".parquet"):
        raise ConfigError(f"unknown table type {path}", expected=".csv or .parquet",
                          got=suffix or "no suffix")
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".csv":
        with path.open("w", newline="") as fh:
            out = csv.writer(fh)
            out.writerow(names)
            for row in rows:
                out.writerow([repr(row[n]) if isinstance(row[n], float) else row[n]
                              for n in names])
        return path
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("Parquet export needs pyarrow", expected="pyarrow installed",
                          got="not importable", fix="pip install pyarrow") from None
    types = {"int": pa.int64(), "float": pa.float64()}
    schema = pa.schema([pa.field(n, types[t], metadata={"doc": d})
                        for n, t, d in STEP_TABLE_COLUMNS])
    pq.write_table(pa.table({n: [r[n] for r in rows] for n in names}, schema=schema), path)
    return path
