"""Duration traces: a CSV `step,stage,chunk,microbatch,kind,ms` with one row per task.

A trace is written from any duration source (a JitterModel, another Trace) or from a recorded
run's spans, read back with validation, and replayed exactly: durations are written with Python's
shortest round-trip float text, so a written-then-read trace gives bit-identical floats.
Validation names the file and line: a missing column, a bad number, a negative duration, an
unknown kind, a duplicate task, a chunk that does not match the placement, and a task missing for
a rank. Steps are numbered 0..N-1 in the file. Durations are in ms.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Iterable, TextIO

import numpy as np

from ..errors import TraceError
from ..placement import Placement
from ..tasks import Kind, Task
from ..telemetry.spans import StepReport

__all__ = ["COLUMNS", "Trace", "read_trace", "write_trace", "trace_from_reports"]

COLUMNS = ("step", "stage", "chunk", "microbatch", "kind", "ms")


class Trace:
    """Task durations of `steps` steps, in ms; `table(step)` has shape (stages, M, 3)."""

    def __init__(self, tables: np.ndarray, *, placement: Placement, split_backward: bool,
                 source: str = "trace", sizes: np.ndarray | None = None) -> None:
        self.tables = np.asarray(tables, dtype=np.float64)
        self._sizes = None if sizes is None else np.asarray(sizes, dtype=np.float64)
        """(steps, M) known microbatch sizes (sim/order.py), where the caller has them"""
        self.measured_bytes: np.ndarray | None = None
        """(steps, stages, M, 2) measured activation bytes (held, the rank's entry input) per
        F, where every step of a run's reports carried them (sim/memory.py replays them)"""
        self.placement = placement
        self.num_steps, _, self.num_microbatches, _ = self.tables.shape
        self.split_backward = split_backward
        self.source = source
        self._lists = self.tables.tolist()

    def table(self, step: int) -> np.ndarray:
        self._check_step(step)
        return self.tables[step]  # type: ignore[no-any-return]

    def sizes(self, step: int) -> np.ndarray | None:
        """The microbatch sizes given for `step`, or None (sim/order.py)."""
        return None if self._sizes is None else self._sizes[step]  # type: ignore[no-any-return]

    def ms(self, step: int, stage: int, microbatch: int, kind: Kind) -> float:
        if step >= self.num_steps:
            self._check_step(step)
        return self._lists[step][stage][microbatch][kind]  # type: ignore[no-any-return]

    def _check_step(self, step: int) -> None:
        if not 0 <= step < self.num_steps:
            raise TraceError(f"{self.source}: no durations for this step", step=step,
                             expected=f"steps 0..{self.num_steps - 1}", got=step)

    def check(self, placement: Placement, num_microbatches: int, split_backward: bool,
              steps: int) -> None:
        """Refuse to replay this trace on a pipeline of another shape."""
        mine = (self.placement.num_stages, self.placement.num_ranks, self.num_microbatches,
                self.split_backward)
        want = (placement.num_stages, placement.num_ranks, num_microbatches, split_backward)
        if mine != want:
            raise TraceError(f"{self.source}: trace is for another pipeline shape",
                             expected="stages, ranks, microbatches, split_backward = "
                             f"{want}", got=f"{mine}")
        if steps > self.num_steps:
            raise TraceError(f"{self.source}: trace has too few steps",
                             expected=f">= {steps} steps", got=self.num_steps)

    def __repr__(self) -> str:
        return (f"<Trace {self.source} steps={self.num_steps} stages="
                f"{self.placement.num_stages} M={self.num_microbatches}>")


def write_trace(dest: str | Path | TextIO, durations: object, *, steps: int = 1) -> None:
    """Write `steps` steps of a duration source (anything with `table(step)`, `placement`,
    `split_backward`) as CSV rows ordered by step, stage, kind, microbatch."""
    placement: Placement = durations.placement  # type: ignore[attr-defined]
    kinds = (Kind.F, Kind.B, Kind.W) if durations.split_backward else (  # type: ignore[attr-defined]
        Kind.F, Kind.B)
    out = io.StringIO()
    out.write(",".join(COLUMNS) + "\n")
    for step in range(steps):
        rows = durations.table(step).tolist()  # type: ignore[attr-defined]
        for stage, per_mb in enumerate(rows):
            chunk = placement.chunk_of(stage)
            for kind in kinds:
                for mb, values in enumerate(per_mb):
                    out.write(f"{step},{stage},{chunk},{mb},{kind.name},{values[kind]!r}\n")
    if isinstance(dest, (str, Path)):
        Path(dest).write_text(out.getvalue())
    else:
        dest.write(out.getvalue())


def _int(text: str, column: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceError(f"{where}: {column} is not an integer", expected="an integer >= 0",
                         got=repr(text)) from None
    if value < 0:
        raise TraceError(f"{where}: negative {column}", expected="an integer >= 0", got=value)
    return value


def _ms(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{where}: ms is not a number", expected="a duration in ms",
                         got=repr(text)) from None
    if not math.isfinite(value):
        raise TraceError(f"{where}: duration is not finite", expected="a finite duration in ms",
                         got=text)
    if value < 0:
        raise TraceError(f"{where}: negative duration", expected="ms >= 0", got=value)
    return value


def _infer_placement(num_stages: int, chunk_of: dict[int, tuple[int, int]], name: str
                     ) -> Placement:
    chunks = 1 + max(c for c, _ in chunk_of.values())
    if chunks == 1:
        return Placement.linear(num_stages)
    if num_stages % chunks:
        raise TraceError(f"{name}: stages do not split evenly into chunks",
                         expected=f"a multiple of {chunks} stages", got=num_stages)
    for style in ("interleaved", "v"):
        try:
            place = Placement(num_stages, num_stages // chunks, style)
        except Exception:
            continue
        if all(place.chunk_of(s) == c for s, (c, _) in chunk_of.items()):
            return place
    raise TraceError(f"{name}: chunk column matches no placement",
                     expected="a linear, interleaved or v placement", got=f"{chunks} chunks")


def read_trace(src: str | Path | TextIO, *, placement: Placement | None = None) -> Trace:
    """Read and validate a trace; `placement` (else inferred from the chunk column) is checked."""
    if isinstance(src, (str, Path)):
        name = str(src)
        try:
            text = Path(src).read_text(encoding="utf-8-sig")  # a spreadsheet's BOM is fine
        except OSError as exc:
            raise TraceError(f"cannot read trace {name}", expected="a readable CSV file",
                             got=exc.strerror) from None
        except UnicodeDecodeError as exc:
            raise TraceError(f"trace {name} is not UTF-8 text", expected="a UTF-8 CSV file",
                             got=f"byte {exc.object[exc.start]:#04x} at offset {exc.start}"
                             ) from None
    else:
        name, text = getattr(src, "name", "trace"), src.read().removeprefix("\ufeff")
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None:
        raise TraceError(f"{name}, line 1: empty trace", expected=",".join(COLUMNS), got="nothing")
    header = [h.strip() for h in header]
    for column in COLUMNS:
        if column not in header:
            raise TraceError(f"{name}, line 1: missing column {column!r}",
                             expected=",".join(COLUMNS), got=",".join(header))
    index = [header.index(c) for c in COLUMNS]
    rows: dict[tuple[int, int, int, int], tuple[float, int]] = {}
    chunk_of: dict[int, tuple[int, int]] = {}
    for fields in reader:
        line = reader.line_num
        where = f"{name}, line {line}"
        if not fields or all(not f.strip() for f in fields):
            continue
        if len(fields) != len(header):
            raise TraceError(f"{where}: wrong number of fields", expected=len(header),
                             got=len(fields))
        step, stage, chunk, mb = (_int(fields[i].strip(), c, where)
                                  for i, c in zip(index[:4], COLUMNS[:4]))
        kind_text = fields[index[4]].strip().upper()
        if kind_text not in Kind.__members__:
            raise TraceError(f"{where}: unknown kind", expected="F, B or W",
                             got=repr(fields[index[4]]))
        kind = Kind[kind_text]
        ms = _ms(fields[index[5]].strip(), where)
        key = (step, stage, mb, int(kind))
        if key in rows:
            raise TraceError(f"{where}: duplicate task", task=Task(kind, mb, chunk), step=step,
                             expected="one row per task",
                             got=f"a second row (first at line {rows[key][1]})")
        seen = chunk_of.setdefault(stage, (chunk, line))
        if seen[0] != chunk:
            raise TraceError(f"{where}: stage {stage} has two chunk numbers",
                             expected=f"chunk {seen[0]} (line {seen[1]})", got=chunk)
        if placement is not None and (stage >= placement.num_stages
                                      or placement.chunk_of(stage) != chunk):
            want = (f"chunk {placement.chunk_of(stage)}" if stage < placement.num_stages
                    else f"stages 0..{placement.num_stages - 1}")
            raise TraceError(f"{where}: row does not fit the placement", expected=want,
                             got=f"stage {stage} chunk {chunk}")
        rows[key] = (ms, line)
    if not rows:
        raise TraceError(f"{name}: no rows", expected="one row per task", got="a header only")
    return _assemble(rows, chunk_of, placement, name)


def _assemble(rows: dict[tuple[int, int, int, int], tuple[float, int]],
              chunk_of: dict[int, tuple[int, int]], placement: Placement | None,
              name: str) -> Trace:
    steps = 1 + max(k[0] for k in rows)
    stages = 1 + max(k[1] for k in rows)
    mbs = 1 + max(k[2] for k in rows)
    split = any(k[3] == Kind.W for k in rows)
    if placement is None:
        placement = _infer_placement(stages, chunk_of, name)
    stages = placement.num_stages
    cells = steps * stages * mbs * (3 if split else 2)
    if cells > max(8 * len(rows), 1 << 20):  # bounded work: the table would be mostly holes
        far = max(rows, key=lambda k: (k[0] * mbs + k[2]))
        raise TraceError(f"{name}: rows span {steps} steps x {stages} stages x {mbs} "
                         f"microbatches but there are only {len(rows)}", step=far[0],
                         expected="one row per task of every rank",
                         got=f"step {far[0]} microbatch {far[2]} at line {rows[far][1]}")
    tables = np.full((steps, stages, mbs, 3), np.nan)
    for (step, stage, mb, kind), (ms, _) in rows.items():
        tables[step, stage, mb, kind] = ms
    if not split:
        tables[..., Kind.W] = 0.0
    missing = np.argwhere(np.isnan(tables))
    if len(missing):
        step, stage, mb, kind = (int(v) for v in missing[0])
        last = max(line for _, line in rows.values())
        task = Task(Kind(kind), mb, placement.chunk_of(stage))
        raise TraceError(f"{name}: a task is missing for rank {placement.rank_of(stage)} "
                         f"(stage {stage}); {len(missing)} missing in all",
                         rank=placement.rank_of(stage), step=step, task=task,
                         expected="one row per task of every rank",
                         got=f"no row for it among lines 2-{last}")
    return Trace(tables, placement=placement, split_backward=split, source=name)


def trace_from_reports(reports: Iterable[StepReport], *, placement: Placement,
                       num_microbatches: int, split_backward: bool, unit_ms: float = 1000.0,
                       source: str = "recorded run") -> Trace:
    """A trace of the spans of recorded steps (renumbered 0..N-1 in the order given).

    `unit_ms` is the loop clock's unit in ms: 1000 for a real loop (seconds), 1 for the
    simulator's virtual clock. Where every report carries its microbatches' costs
    (`StepReport.costs`), they are the trace's sizes (sim/order.py).
    """
    reports = list(reports)
    rows: dict[tuple[int, int, int, int], tuple[float, int]] = {}
    chunk_of: dict[int, tuple[int, int]] = {}
    for step, report in enumerate(reports):
        for i, span in enumerate(report.spans):
            key = (step, span.stage, span.microbatch, int(span.kind))
            rows[key] = ((span.end - span.start) * unit_ms, i)
            chunk_of.setdefault(span.stage, (span.chunk, i))
    if not rows:
        raise TraceError(f"{source}: no spans", expected="recorded steps", got="none")
    trace = _assemble(rows, chunk_of, placement, source)
    trace.check(placement, num_microbatches, split_backward, trace.num_steps)
    if all(r.costs is not None for r in reports):
        trace._sizes = np.array([r.costs for r in reports], dtype=np.float64)
    cells = placement.num_stages * num_microbatches
    if reports and all(len(r.activation_bytes) == cells for r in reports):
        held = np.zeros((len(reports), placement.num_stages, num_microbatches, 2))
        for step, report in enumerate(reports):
            for (stage, mb), values in report.activation_bytes.items():
                held[step, stage, mb] = values
        trace.measured_bytes = held
    return trace
