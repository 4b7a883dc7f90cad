"""Occupancy: where each rank's time went over a window, from spans alone.

Four states that add up to the window, per rank:
- busy: a task of the rank ran (the union of its spans);
- gated: not busy, but some task of the rank was ready and had not started (held back by the
  cap, the memory gate of docs/hints.md, by the ready policy's reservation, or by strict
  mode's order);
- waiting: not busy and nothing ready, while the rank still had tasks of the step to run
  (waiting for an activation or a gradient);
- idle: the rest (between steps, or done with the step).
Per chunk, the busy share of its own tasks. Everything is exact interval arithmetic on the
spans' times (no sampling), so the numbers of a finished step equal what its spans say.
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
    chunks: dict[int, float]  # chunk -> busy share

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "busy": self.busy, "waiting": self.waiting,
                "gated": self.gated, "idle": self.idle,
                "chunks": {str(c): v for c, v in sorted(self.chunks.items())}}


def occupancy(steps: Sequence[StepWindow], ranks: Sequence[int], lo: float, hi: float
              ) -> list[RankOccupancy]:
    """Each rank's four shares of [lo, hi] (fractions; all 0 when the window is empty)."""
    width = hi - lo
    out = []
    for rank in ranks:
        mine = [s for st in steps for s in st.spans if s.rank == rank]
        busy = union([(s.start, s.end) for s in mine])
        gated = subtract(union([(s.ready, s.start) for s in mine]), busy)
        active = []
        for st in steps:
            spans = [s for s in st.spans if s.rank == rank]
            done = len(spans) >= st.tasks_per_rank.get(rank, 0)
            if done:  # active until its last task ended
                stop = max((s.end for s in spans), default=st.start)
            else:  # still has tasks: active until the step ends, or now
                stop = st.end if st.end is not None else hi
            active.append((st.start, stop))
        waiting = subtract(subtract(union(active), busy), gated)
        chunks = {c: length(union([(s.start, s.end) for s in mine if s.chunk == c]), lo, hi)
                  for c in sorted({s.chunk for s in mine})}
        if width <= 0:
            out.append(RankOccupancy(rank, 0.0, 0.0, 0.0, 0.0, {c: 0.0 for c in chunks}))
            continue
        b, g, w = (length(x, lo, hi) / width for x in (busy, gated, waiting))
        out.append(RankOccupancy(rank, b, w, g, max(0.0, 1.0 - b - g - w),
                                 {c: v / width for c, v in chunks.items()}))
    return out
