"""ZBV: zero bubble on the V placement (Qi et al., arXiv 2401.10241 section 6; torch 2.13
ScheduleZBVZeroBubble).

Rank r holds chunk 0 = stage r and chunk 1 = stage 2R-1-r, so a microbatch goes down the ranks
on chunk 0, turns on rank R-1 without a message, comes back up on chunk 1, and its loss is on
rank 0 (docs/hints.md "Placements"). From the paper: with T_F = T_B = T_W the bubble is only the
start-up skew, and each rank holds 2R chunk activations at its peak. Our reading of the phases, as
torch realizes them (reproduced literally for R=4, M=8 in the tests), over n = max(2R-1, M)
microbatches, those >= M then dropped:
  warmup   2(R-r)-1 chunk-0 F; then r times (F chunk 1, F chunk 0); then R-r times
           (F, B, W on chunk 1)
  steady   until chunk 1 has caught up: [F chunk 0 while any left], B W chunk 0, F B W chunk 1
  cooldown r times (B chunk 0, B chunk 1); R-r times (B chunk 0, W of the oldest chunk-0 B);
           then the chunk-1 W's left, then the chunk-0 W's left.
"""

from __future__ import annotations

from ..errors import HintError
from ..hints import HintOrder
from ..placement import Placement
from ..tasks import Kind, Task

__all__ = ["zbv", "zbv_rank"]


def zbv_rank(rank: int, num_ranks: int, num_microbatches: int) -> list[Task]:
    R, r = num_ranks, rank
    n = max(2 * R - 1, num_microbatches)
    nxt = {(k, c): 0 for k in Kind for c in (0, 1)}
    out: list[Task] = []

    def emit(kind: Kind, chunk: int) -> None:
        out.append(Task(kind, nxt[(kind, chunk)], chunk))
        nxt[(kind, chunk)] += 1

    for _ in range(2 * (R - r) - 1):
        emit(Kind.F, 0)
    for _ in range(r):
        emit(Kind.F, 1)
        emit(Kind.F, 0)
    for _ in range(R - r):
        for kind in Kind:
            emit(kind, 1)
    while nxt[(Kind.F, 1)] < nxt[(Kind.F, 0)] or nxt[(Kind.F, 0)] < n:
        if nxt[(Kind.F, 0)] < n:
            emit(Kind.F, 0)
        emit(Kind.B, 0)
        emit(Kind.W, 0)
        for kind in Kind:
            emit(kind, 1)
    for _ in range(r):
        emit(Kind.B, 0)
        emit(Kind.B, 1)
    for _ in range(R - r):
        emit(Kind.B, 0)
        emit(Kind.W, 0)
    for chunk in (1, 0):
        while nxt[(Kind.W, chunk)] < nxt[(Kind.B, chunk)]:
            emit(Kind.W, chunk)
    return [t for t in out if t.microbatch < num_microbatches]


def zbv(placement: Placement, num_microbatches: int, *, split_backward: bool) -> HintOrder:
    if placement.style != "v":
        raise HintError("zbv needs the V placement", expected="v", got=placement.style)
    if not split_backward:
        raise HintError("zbv needs split backward", expected="split_backward=True",
                        got="split_backward=False")
    R = placement.num_ranks
    orders = tuple(tuple(zbv_rank(r, R, num_microbatches)) for r in range(R))
    return HintOrder("zbv", placement, num_microbatches, True, orders)
