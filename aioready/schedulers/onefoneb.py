"""1F1B / PipeDream-Flush (Narayanan et al., 2021): warm up with R-1-r forwards on rank r, then
alternate one forward and one backward, then drain the backwards.

Generated here from the formula, not imported from torch: torch 2.13's Schedule1F1B IR has an
off-by-one on the last rank (docs/hints.md "Importing torch schedules"). With split backward each W
follows its B directly (our reading); ZB-H1 is the schedule that defers W. Peak in-flight on rank r
is min(M, R-r).
"""

from __future__ import annotations

from ..errors import HintError
from ..hints import HintOrder
from ..placement import Placement
from ..tasks import Kind, Task

__all__ = ["one_f_one_b", "one_f_one_b_rank"]


def one_f_one_b_rank(rank: int, num_ranks: int, num_microbatches: int,
                     split_backward: bool) -> list[Task]:
    M = num_microbatches
    warmup = min(num_ranks - 1 - rank, M)
    order = [Task(Kind.F, m) for m in range(warmup)]

    def backward(m: int) -> None:
        order.append(Task(Kind.B, m))
        if split_backward:
            order.append(Task(Kind.W, m))

    for i in range(M - warmup):
        order.append(Task(Kind.F, warmup + i))
        backward(i)
    for m in range(M - warmup, M):
        backward(m)
    return order


def one_f_one_b(placement: Placement, num_microbatches: int, *,
                split_backward: bool) -> HintOrder:
    if placement.num_chunks != 1:
        raise HintError("1f1b runs one chunk per rank", expected="linear placement",
                        got=placement.style, fix="use interleaved-1f1b for several chunks")
    R = placement.num_ranks
    orders = tuple(tuple(one_f_one_b_rank(r, R, num_microbatches, split_backward))
                   for r in range(R))
    return HintOrder("1f1b", placement, num_microbatches, split_backward, orders)
