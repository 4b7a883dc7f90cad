"""Exports of step reports: Chrome trace JSON, CSV, Parquet, and readers for the first two.

- Chrome trace event format (Perfetto, chrome://tracing): one process row per rank (pid = rank),
  one complete event ("ph": "X") per task, named by its text form (`F3`, `B0c1`), category and
  colour (`cname`) by kind, the same colours as the PNG timelines (telemetry/plots.py). Times in
  microseconds from the first step's start; the steps' own start and end ride in `otherData`.
- CSV: one row per task, `step,rank,stage,chunk,microbatch,kind,ready_s,start_s,end_s`, floats
  written with repr so a file reads back to the very same spans.
- Parquet (same columns) when pyarrow is installed; all three read back (`read_reports`).
Torch- and mpi4py-free.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Sequence

from ..errors import ConfigError, TraceError
from ..tasks import Kind
from .spans import Span, StepReport

__all__ = ["KIND_CNAME", "KIND_COLOR", "CSV_COLUMNS", "chrome_trace", "write_chrome_trace",
           "read_chrome_trace", "write_csv", "read_csv", "write_parquet", "read_parquet",
           "read_reports", "spans_table", "reports_from_table"]

KIND_CNAME = {Kind.F: "thread_state_runnable", Kind.B: "good", Kind.W: "yellow"}
KIND_COLOR = {Kind.F: "#4C78A8", Kind.B: "#59A14F", Kind.W: "#EDC948"}
CSV_COLUMNS = ("step", "rank", "stage", "chunk", "microbatch", "kind", "ready_s", "start_s",
               "end_s")


def _num_ranks(reports: Sequence[StepReport]) -> int:
    return max(max((r.num_ranks for r in reports), default=1),
               1 + max((s.rank for r in reports for s in r.spans), default=0))


def chrome_trace(reports: Sequence[StepReport], *, clock_unit_s: float = 1.0
                 ) -> dict[str, Any]:
    """A Chrome trace (JSON object format) of the steps. `clock_unit_s`: seconds per unit of
    the reports' clock (1.0 for real loops; the simulator's virtual clock counts ms: 1e-3)."""
    if not reports:
        raise ConfigError("nothing to export", expected="at least one step report", got=0)
    origin = min(r.start for r in reports)
    scale = 1e6 * clock_unit_s

    def us(t: float) -> float:
        return round((t - origin) * scale, 3)

    events: list[dict[str, Any]] = []
    for rank in range(_num_ranks(reports)):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0,
                       "args": {"name": "device"}})
    for rep in reports:
        for s in rep.spans:
            events.append({
                "name": s.label, "cat": s.kind.name, "ph": "X", "ts": us(s.start),
                "dur": round((s.end - s.start) * scale, 3), "pid": s.rank, "tid": 0,
                "cname": KIND_CNAME[s.kind],
                "args": {"step": rep.step, "stage": s.stage, "chunk": s.chunk,
                         "microbatch": s.microbatch, "ready_us": us(s.ready),
                         "waited_us": round((s.start - s.ready) * scale, 3)}})
    steps = [[r.step, us(r.start), us(r.end), r.num_ranks] for r in reports]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": "aioready", "origin_s": repr(origin * clock_unit_s),
                          "steps": json.dumps(steps)}}


def write_chrome_trace(reports: Sequence[StepReport], path: str | Path, *,
                       clock_unit_s: float = 1.0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(reports, clock_unit_s=clock_unit_s)))
    return path


def _group(rows: list[tuple[int, Span]], bounds: dict[int, tuple[float, float, int]]
           ) -> list[StepReport]:
    by_step: dict[int, list[Span]] = {}
    for step, span in rows:
        by_step.setdefault(step, []).append(span)
    reports = []
    for step in sorted(by_step):
        spans = by_step[step]
        start, end, n = bounds.get(step, (min(s.ready for s in spans),
                                          max(s.end for s in spans),
                                          1 + max(s.rank for s in spans)))
        reports.append(StepReport(step, spans, start, end, n))
    return reports


def read_chrome_trace(path: str | Path) -> list[StepReport]:
    """Step reports back from a trace written by write_chrome_trace (times in seconds, from 0)."""
    try:
        data = json.loads(Path(path).read_text())
        events = data["traceEvents"] if isinstance(data, dict) else data
        rows = []
        for e in events:
            if e.get("ph") != "X" or e.get("cat") not in ("F", "B", "W"):
                continue
            a = e["args"]
            start = e["ts"] / 1e6
            rows.append((int(a["step"]), Span(int(e["pid"]), int(a["stage"]), int(a["chunk"]),
                                               int(a["microbatch"]), Kind[e["cat"]],
                                               a["ready_us"] / 1e6, start,
                                               start + e["dur"] / 1e6)))
        other = data.get("otherData", {}) if isinstance(data, dict) else {}
        bounds = {int(s): (b / 1e6, e / 1e6, int(n))
                  for s, b, e, n in json.loads(other.get("steps", "[]"))}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TraceError(f"cannot read Chrome trace {path}", expected="a trace written by "
                         "aioready (complete events with step/stage/chunk/microbatch args)",
                         got=f"{type(exc).__name__}: {exc}") from exc
    if not rows:
        raise TraceError(f"Chrome trace {path} holds no task events",
                         expected="complete events of category F, B or W", got=0)
    return _group(rows, bounds)


def _rows(reports: Sequence[StepReport]) -> list[tuple[Any, ...]]:
    return [(r.step, s.rank, s.stage, s.chunk, s.microbatch, s.kind.name, s.ready, s.start,
             s.end) for r in reports for s in r.spans]


def write_csv(reports: Sequence[StepReport], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(CSV_COLUMNS)
        for row in _rows(reports):
            out.writerow([*row[:6], *(repr(float(v)) for v in row[6:])])
    return path


def read_csv(path: str | Path) -> list[StepReport]:
    """Step reports back from write_csv's file (a step's start and end: its spans' extent)."""
    rows = []
    try:
        with Path(path).open(newline="") as fh:
            reader = csv.DictReader(fh)
            if tuple(reader.fieldnames or ()) != CSV_COLUMNS:
                raise ValueError(f"header {reader.fieldnames}")
            for line, rec in enumerate(reader, start=2):
                try:
                    rows.append((int(rec["step"]), Span(
                        int(rec["rank"]), int(rec["stage"]), int(rec["chunk"]),
                        int(rec["microbatch"]), Kind[rec["kind"]], float(rec["ready_s"]),
                        float(rec["start_s"]), float(rec["end_s"]))))
                except (KeyError, ValueError, TypeError) as exc:
                    raise ValueError(f"line {line}: {exc}") from exc
    except (OSError, ValueError) as exc:
        raise TraceError(f"cannot read span CSV {path}", expected=",".join(CSV_COLUMNS),
                         got=str(exc)) from exc
    if not rows:
        raise TraceError(f"span CSV {path} has no rows", expected="one row per task", got=0)
    return _group(rows, {})


def spans_table(reports: Sequence[StepReport], *, unit_ms: float = 1000.0) -> dict[str, Any]:
    """The CSV's rows as plain JSON data, times in ms (`unit_ms`: ms per clock unit): what the
    `aioready train --json` summary carries so `aioready advise` can read it alone."""
    columns = [*CSV_COLUMNS[:6], "ready_ms", "start_ms", "end_ms"]
    return {"columns": columns, "rows": [[*row[:6], *(float(v) * unit_ms for v in row[6:])]
                                         for row in _rows(reports)]}


def reports_from_table(table: dict[str, Any]) -> list[StepReport]:
    """Inverse of spans_table (times stay in ms); TraceError on a malformed table."""
    try:
        index = [table["columns"].index(c) for c in (*CSV_COLUMNS[:6], "ready_ms", "start_ms",
                                                      "end_ms")]
        rows = [(int(r[index[0]]), Span(*(int(r[i]) for i in index[1:5]), Kind[r[index[5]]],
                                        *(float(r[i]) for i in index[6:])))
                for r in table["rows"]]
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise TraceError("malformed span table", expected="columns " + ",".join(CSV_COLUMNS[:6])
                         + ",ready_ms,start_ms,end_ms and rows", got=f"{type(exc).__name__}: "
                         f"{exc}") from exc
    if not rows:
        raise TraceError("span table has no rows", expected="one row per task", got=0)
    return _group(rows, {})


def write_parquet(reports: Sequence[StepReport], path: str | Path) -> Path:
    """The CSV's columns as a Parquet file; needs pyarrow."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("Parquet export needs pyarrow", expected="pyarrow installed",
                          got="not importable", fix="pip install pyarrow") from None
    rows = _rows(reports)
    table = pa.table({name: [r[i] for r in rows] for i, name in enumerate(CSV_COLUMNS)})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def read_parquet(path: str | Path) -> list[StepReport]:
    """Step reports back from write_parquet's file; needs pyarrow."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("Parquet import needs pyarrow", expected="pyarrow installed",
                          got="not importable", fix="pip install pyarrow") from None
    try:
        cols = pq.read_table(path).to_pydict()
        rows = [(int(step), Span(int(rank), int(stage), int(chunk), int(mb), Kind[kind],
                                 float(ready), float(start), float(end)))
                for step, rank, stage, chunk, mb, kind, ready, start, end
                in zip(*(cols[c] for c in CSV_COLUMNS))]
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise TraceError(f"cannot read span Parquet {path}", expected=",".join(CSV_COLUMNS),
                         got=f"{type(exc).__name__}: {exc}") from exc
    if not rows:
        raise TraceError(f"span Parquet {path} has no rows", expected="one row per task", got=0)
    return _group(rows, {})


def read_reports(path: str | Path) -> list[StepReport]:
    """Step reports from a Chrome trace (.json), a span CSV (.csv) or Parquet (.parquet).

    Not a duration trace (aioready.sim.traces.read_trace): this reads what a run recorded."""
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        return read_chrome_trace(path)
    if suffix == ".csv":
        return read_csv(path)
    if suffix == ".parquet":
        return read_parquet(path)
    raise TraceError(f"unknown trace file type {path}",
                     expected=".json (Chrome trace), .csv or .parquet",
                     got=suffix or "no suffix")
