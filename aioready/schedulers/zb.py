"""Zero-bubble schedules on the linear placement (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, arXiv 2401.10241).

ZB-H1 (paper 2.1): 1F1B with the backward split into B (input gradient) and W (weight
gradient); rank r warms up with R-1-r forwards and runs no W in its first r backward steps, then
the W of the oldest pending B in every step, so W fills the 1F1B bubble. Bubble
(R-1)(T_F+T_B-T_W), peak in flight R on every rank. The order is torch's
`_get_1f1b_rank_ops(..., enable_zero_bubble=True)` with v=1, reproduced for R=4, M=8.

ZB-H2: our reading, not the paper's hand-made order. The paper warms up with 2(R-1-r)+1
forwards and reshapes the tail into a parallelogram; we derive the order by list-scheduling the
BFW rule (B > F > W, oldest first) under unit durations with an in-flight cap of 2R-1 on every
rank (docs/hints.md "Reference orders" lists the result for R=4, M=8; it reaches the barrier lower
bound 3M + R-1 there). Peak in flight: up to 2R-1.
"""

from __future__ import annotations

from ..errors import HintError
from ..hints import HintOrder
from ..placement import Placement
from .interleaved import steady_order
from .listsched import list_schedule
from .rules import rule_orders

__all__ = ["zb_h1", "zb_h2"]


def _check(name: str, placement: Placement, split_backward: bool) -> None:
    if placement.num_chunks != 1:
        raise HintError(f"{name} runs one chunk per rank", expected="linear placement",
                        got=placement.style, fix="use zbv or interleaved-zb for two chunks")
    if not split_backward:
        raise HintError(f"{name} needs split backward", expected="split_backward=True",
                        got="split_backward=False")


def zb_h1(placement: Placement, num_microbatches: int, *, split_backward: bool) -> HintOrder:
    _check("zb-h1", placement, split_backward)
    R, M = placement.num_ranks, num_microbatches
    orders = tuple(
        tuple(steady_order(num_chunks=1, num_microbatches=M, warmup=R - 1 - r, per_round=M,
                           split_backward=True, w_delay=r))
        for r in range(R))
    return HintOrder("zb-h1", placement, M, True, orders)


def zb_h2(placement: Placement, num_microbatches: int, *, split_backward: bool) -> HintOrder:
    _check("zb-h2", placement, split_backward)
    R, M = placement.num_ranks, num_microbatches
    ranking = rule_orders(placement, M, True, "bfw")
    caps = [min(M, 2 * R - 1)] * R
    result = list_schedule(placement, M, True, ranking, caps)
    return HintOrder("zb-h2", placement, M, True, result.orders)
