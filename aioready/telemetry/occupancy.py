"""Occupancy: where each rank's time went over a window, from spans alone.

Four states that add up to the window, per rank:
- busy: a task of the rank ran (the union of its spans);
- gated: not busy, but some task of the rank was ready and had not started (held back by the
  cap, the memory gate of docs/hints.md, by the ready policy's reservation, or by strict
  mode's order);
- waiting: not busy and nothing ready, while the rank still had tasks of the step to run
  (waiting for an activation or a gradient);
- idle: the rest (between steps, or done with the step).
Per chunk the same four over its own tasks, plus "other": the device ran another chunk.
Everything is exact interval arithmetic on the spans' times (no sampling), so the numbers of a
finished step equal what its spans say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .spans import Span

__all__ = ["StepWindow", "RankOccupancy", "occupancy", "union", "length", "subtract"]

Intervals = list[tuple[float, float]]


def union(intervals: Sequence[tuple[float, float]]) -> Intervals:
    """Sorted, disjoint intervals covering the same points (empty ones dropped)."""
    out: Intervals = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def subtract(base: Intervals, cut: Intervals) -> Intervals:
    """`base` minus `cut` (both as union() returns them)."""
    out: Intervals = []
    for a, b in base:
        pieces = [(a, b)]
        for c, d in cut:
            if d <= a or c >= b:
                continue
            pieces = [p for x, y in pieces for p in ((x, min(y, c)), (max(x, d), y))
                      if p[1] > p[0]]
        out.extend(pieces)
    return out


def length(intervals: Intervals, lo: float, hi: float) -> float:
    """Total length of `intervals` inside [lo, hi]."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)


@dataclass(frozen=True, slots=True)
class StepWindow:
    """One step as occupancy needs it: its spans, its start, and its end (None: running)."""

    spans: Sequence[Span]
    start: float
    end: float | None
    tasks_per_rank: dict[int, int]  # how many tasks each rank runs in a step


@dataclass(frozen=True, slots=True)
class RankOccupancy:
    rank: int
    busy: float
    waiting: float
    gated: float
    idle: float
    chunks: dict[int, dict[str, float]]
    """per chunk: busy, other (the device ran another chunk), waiting, gated, idle"""

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "busy": self.busy, "waiting": self.waiting,
                "gated": self.gated, "idle": self.idle,
                "chunks": {str(c): v for c, v in sorted(self.chunks.items())}}


def _active(steps: Sequence[StepWindow], rank: int, chunk: int | None, per_step: float,
            hi: float) -> Intervals:
    """When the rank (or its chunk) still had tasks of a step to run: from the step's start to
    its last task's end once all `per_step` ran, else to the step's end (or `hi`, now, while it
    runs)."""
    out = []
    for st in steps:
        mine = [s for s in st.spans if s.rank == rank and chunk in (None, s.chunk)]
        if len(mine) >= per_step:
            out.append((st.start, max((s.end for s in mine), default=st.start)))
        else:
            out.append((st.start, st.end if st.end is not None else hi))
    return union(out)


def _states(spans: Sequence[Span], device: Intervals, active: Intervals
            ) -> tuple[Intervals, Intervals, Intervals, Intervals]:
    """busy (its own spans), other (the device ran something else), gated, waiting."""
    busy = union([(s.start, s.end) for s in spans])
    gated = subtract(union([(s.ready, s.start) for s in spans]), device)
    return (busy, subtract(device, busy), gated,
            subtract(subtract(active, device), gated))


def occupancy(steps: Sequence[StepWindow], ranks: Sequence[int], lo: float, hi: float
              ) -> list[RankOccupancy]:
    """Each rank's (and chunk's) shares of [lo, hi] (fractions; 0 when the window is empty)."""
    width = hi - lo

    def share(intervals: Intervals) -> float:
        return length(intervals, lo, hi) / width if width > 0 else 0.0

    out = []
    for rank in ranks:
        mine = [s for st in steps for s in st.spans if s.rank == rank]
        device = union([(s.start, s.end) for s in mine])
        per_step = max((st.tasks_per_rank.get(rank, 0) for st in steps), default=0)
        busy, _, gated, waiting = _states(mine, device, _active(steps, rank, None, per_step, hi))
        b, g, w = share(busy), share(gated), share(waiting)
        chunk_ids = sorted({s.chunk for s in mine})
        chunks = {}
        for c in chunk_ids:
            spans = [s for s in mine if s.chunk == c]
            parts = _states(spans, device, _active(steps, rank, c, per_step / len(chunk_ids), hi))
            cb, co, cg, cw = (share(x) for x in parts)
            chunks[c] = {"busy": cb, "other": co, "waiting": cw, "gated": cg,
                         "idle": max(0.0, 1.0 - cb - co - cg - cw) if width > 0 else 0.0}
        out.append(RankOccupancy(rank, b, w, g, max(0.0, 1.0 - b - g - w) if width > 0
                                 else 0.0, chunks))
    return out
