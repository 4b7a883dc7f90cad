"""Gather every rank's step reports (and losses) to one rank, as numbers over MPI.

Spans travel as float64 arrays (telemetry.spans_to_array) through nonblocking collectives
(Igather of the counts, then Igatherv of the rows), awaited by test-and-backoff so the event
loop keeps running; nothing is pickled. Times are each process's loop clock (CLOCK_MONOTONIC):
comparable between ranks of one host; across hosts, steps line up by their own starts only.
mpi4py is imported when a gather runs, never at module load.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Awaitable, Callable, Sequence, TypeVar

from ..errors import ConfigError
from .spans import SPAN_COLUMNS, StepReport, spans_from_array, spans_to_array

__all__ = ["gather_reports", "gather_rows", "merge_rows", "reduce_sum", "broadcast_ints",
           "root_decides", "barrier", "STEP_COLUMNS"]

STEP_COLUMNS = ("step", "start", "end", "peak_in_flight", "loss", "num_ranks", "rank",
                "has_loss", "peak_activation_bytes")
ACTIVATION_COLUMNS = ("step", "stage", "microbatch", "held_bytes", "input_bytes")
# has_loss, not a NaN loss, says "this rank has no loss": a diverged (NaN) loss must arrive as NaN


async def _wait(request: Any) -> None:
    delay = 0.0
    while not request.Test():
        await asyncio.sleep(delay)
        delay = min(2 * delay + 1e-5, 2e-3)


async def _gatherv(comm: Any, rows: Any, width: int, root: int) -> Any:
    import numpy as np
    size = comm.Get_size()
    count = np.array([rows.size], dtype=np.int64)
    counts = np.zeros(size, dtype=np.int64) if comm.Get_rank() == root else None
    await _wait(comm.Igather(count, counts, root=root))
    if comm.Get_rank() != root:
        await _wait(comm.Igatherv(np.ascontiguousarray(rows, dtype=np.float64), None,
                                  root=root))
        return None
    assert counts is not None
    displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
    out = np.empty(int(counts.sum()), dtype=np.float64)
    await _wait(comm.Igatherv(np.ascontiguousarray(rows, dtype=np.float64),
                              [out, (counts, displs)], root=root))
    return out.reshape(-1, width)


async def gather_reports(reports: Sequence[StepReport], comm: Any, *,
                         losses: Sequence[Any] | None = None, root: int = 0,
                         activations: bool = False
                         ) -> list[tuple[StepReport, float | None]] | None:
    """Merge every rank's reports of the same steps on `root`; None on the other ranks.

    Every rank must call it with the same steps (and the same `activations`). `losses[i]` is
    this rank's loss of step i (None where the rank has no loss). `activations`: also each
    forward's measured bytes (StepReport.activation_bytes, what hint="auto" chooses within a
    byte budget on). Returns (merged report, loss) per step on `root`.
    """
    import numpy as np
    rank = comm.Get_rank()
    spans = [spans_to_array(r) for r in reports]
    span_rows = np.concatenate(spans) if spans else np.zeros((0, len(SPAN_COLUMNS)))
    step_rows = np.array([
        (r.step, r.start, r.end, r.peak_in_flight.get(rank, -1),
         _as_float(losses[i] if losses is not None else None), r.num_ranks, rank,
         losses is not None and losses[i] is not None, r.peak_activation_bytes.get(rank, -1))
        for i, r in enumerate(reports)], dtype=np.float64).reshape(-1, len(STEP_COLUMNS))
    all_spans = await _gatherv(comm, span_rows, len(SPAN_COLUMNS), root)
    all_steps = await _gatherv(comm, step_rows, len(STEP_COLUMNS), root)
    held = None
    if activations:
        mine = np.array([(r.step, stage, mb, b, source) for r in reports
                         for (stage, mb), (b, source) in r.activation_bytes.items()],
                        dtype=np.float64).reshape(-1, len(ACTIVATION_COLUMNS))
        held = await _gatherv(comm, mine, len(ACTIVATION_COLUMNS), root)
    if rank != root:
        return None
    merged = merge_rows(all_spans, all_steps)
    if held is not None:
        by_step = {report.step: report for report, _ in merged}
        for step, stage, mb, b, source in held.tolist():
            by_step[int(step)].activation_bytes[(int(stage), int(mb))] = (b, source)
    return merged


async def gather_rows(comm: Any, rows: Any, width: int, *, root: int = 0) -> Any:
    """Every rank's float64 rows of `width` columns, stacked on `root` in rank order (None on
    the others): a buffer gather, no pickle."""
    return await _gatherv(comm, rows, width, root)


async def barrier(comm: Any) -> None:
    """Wait for every rank (e.g. before the first step, so start-up skew is not timed)."""
    await _wait(comm.Ibarrier())


async def reduce_sum(comm: Any, value: int, *, root: int = 0) -> int | None:
    """Sum an integer over the ranks on `root` (None elsewhere): a buffer reduce, no pickle."""
    import numpy as np
    send = np.array([value], dtype=np.int64)
    recv = np.zeros(1, dtype=np.int64) if comm.Get_rank() == root else None
    await _wait(comm.Ireduce(send, recv, root=root))
    return None if recv is None else int(recv[0])


async def broadcast_ints(comm: Any, values: Sequence[int] | None, count: int, *,
                         root: int = 0) -> list[int]:
    """`count` integers from `root` (which passes them; the others pass None) to every rank:
    a buffer broadcast, no pickle."""
    import numpy as np
    buf = (np.array(values, dtype=np.int64) if comm.Get_rank() == root
           else np.zeros(count, dtype=np.int64))
    if buf.shape != (count,):
        raise ValueError(f"broadcast_ints: {buf.shape[0]} values, expected {count}")
    await _wait(comm.Ibcast(buf, root=root))
    return [int(v) for v in buf]


T = TypeVar("T")


async def root_decides(comm: Any, decide: Callable[[], Awaitable[T]] | None, count: int, *,
                       encode: Callable[[T], Sequence[int]],
                       decode: Callable[[Sequence[int]], T], what: str) -> T:
    """Rank 0 runs `decide` (the other ranks pass None) and every rank returns its answer,
    sent as `count` integers. Rank 0's error is raised on rank 0 and a ConfigError naming it on
    the others, after the broadcast: no rank waits for an answer that never comes."""
    answer: T | None = None
    error: BaseException | None = None
    if decide is not None:
        try:
            answer = await decide()
        except Exception as exc:
            error = exc
    values = await broadcast_ints(comm, None if decide is None else [-1] * count
                                  if answer is None else list(encode(answer)), count)
    if error is not None:
        raise error
    if values[0] < 0:
        raise ConfigError(f"hint='auto': rank 0 found no {what}", rank=comm.Get_rank(),
                          expected=f"{what} from rank 0", got="its error (see rank 0's output)")
    return answer if answer is not None else decode(values)


def merge_rows(span_rows: Any, step_rows: Any) -> list[tuple[StepReport, float | None]]:
    """Rebuild merged step reports from gathered span and step rows.

    Note [step start across processes]: ranks run their steps independently, so a rank that
    finished step k early (the last stage, in 1F1B) starts step k+1 while stage 0 still works on
    step k, and waits there. A merged step therefore starts when the rank holding stage 0 starts
    it (no task of the step can run earlier) and ends when the last rank ends it; steps then do
    not overlap and their times add up to the run's wall time. In one process every rank starts
    together and this is the earliest start.
    """
    merged: dict[int, StepReport] = {}
    losses: dict[int, float | None] = {}
    starts: dict[tuple[int, int], float] = {}
    for (step_f, start, end, peak, loss, num_ranks, rank_f, has_loss,
         held) in step_rows.tolist():
        step, rank = int(step_f), int(rank_f)
        rep = merged.get(step)
        if rep is None:
            rep = merged[step] = StepReport(step, start=start, end=end, num_ranks=int(num_ranks))
            losses[step] = None
        rep.start, rep.end = min(rep.start, start), max(rep.end, end)
        starts[(step, rank)] = start
        if peak >= 0:
            rep.peak_in_flight[rank] = int(peak)
        if held >= 0:
            rep.peak_activation_bytes[rank] = int(held)
        if has_loss:
            losses[step] = loss
    for step, span in spans_from_array(span_rows):
        merged[step].spans.append(span)
        if span.stage == 0 and (step, span.rank) in starts:
            merged[step].start = starts[(step, span.rank)]
    return [(merged[s], losses[s]) for s in sorted(merged)]


def _as_float(loss: Any) -> float:
    if loss is None:
        return math.nan
    return float(loss.item() if hasattr(loss, "item") else loss)
