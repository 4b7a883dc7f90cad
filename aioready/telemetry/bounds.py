"""The lower bound of a step from its realised durations (communication ignored).

LB = max(longest dependency chain, max over ranks r of head_r + busy_r + tail_r): `busy_r` is the
sum of r's task durations, `head_r` the least time any microbatch needs to reach r's first stage,
and `tail_r` (unsplit backward only) the least time a gradient needs from r's first stage back to
stage 0; with split backward W can fill that tail. With no jitter this makes 1F1B and GPipe
exactly 1.0 efficient. Efficiency = LB / step time: every benchmark and every step's metrics
report it, for real runs and simulated ones alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from ..tasks import Kind

if TYPE_CHECKING:
    from ..placement import Placement

__all__ = ["lower_bound", "lower_bound_table", "forward_flow", "chain_bound",
           "any_placement_bound", "in_order_bound"]


def lower_bound_table(placement: Placement, table: np.ndarray, split_backward: bool) -> float:
    """The lower bound of one step from its duration table (stages, microbatches, 3)."""
    F, B = table[:, :, Kind.F], table[:, :, Kind.B]
    W = table[:, :, Kind.W] if split_backward else np.zeros_like(F)
    f_end = np.cumsum(F, axis=0)  # F(s,m) ends after every F up to s
    chain = chain_bound(table, split_backward)
    before_f = np.vstack([np.zeros((1, F.shape[1])), f_end])  # F of stages < s
    before_b = np.vstack([np.zeros((1, B.shape[1])), np.cumsum(B, axis=0)])  # B of stages < s
    busy = (F + B + W).sum(axis=1)
    best = chain
    for rank in range(placement.num_ranks):
        stages = list(placement.stages_of(rank))
        first = min(stages)
        head = float(before_f[first].min())
        tail = 0.0 if split_backward else float(before_b[first].min())
        best = max(best, head + float(busy[stages].sum()) + tail)
    return best


def chain_bound(table: np.ndarray, split_backward: bool) -> float:
    """The longest dependency chain of one microbatch: every F in stage order, every B back,
    then that stage's W; a bound on any schedule of these stages on any ranks."""
    F, B = table[:, :, Kind.F], table[:, :, Kind.B]
    W = table[:, :, Kind.W] if split_backward else np.zeros_like(F)
    b_end = np.cumsum(F, axis=0)[-1] + np.cumsum(B[::-1], axis=0)[::-1]  # after B of >= s
    return float(np.max(b_end + W))


def any_placement_bound(table: np.ndarray, num_ranks: int) -> float:
    """A bound on any schedule of any placement of these stages (kept whole, or merged) on
    `num_ranks` ranks, backward split or not: max(the split chain, all work / ranks). Merging
    stages or not splitting backward only lengthens the chain; some rank runs at least the
    mean share of the work. `table` has W (split) durations; unsplit B is their B + W."""
    return max(chain_bound(table, True), float(table.sum()) / num_ranks)


def lower_bound(placement: Placement, num_microbatches: int, split_backward: bool,
                duration: Callable[[int, int, Kind], float]) -> float:
    """The lower bound of docs/architecture.md "Lower bound"; `duration(stage, microbatch, kind)`
    gives realised durations."""
    kinds = (Kind.F, Kind.B, Kind.W) if split_backward else (Kind.F, Kind.B)
    table = np.zeros((placement.num_stages, num_microbatches, 3))
    for s in range(placement.num_stages):
        for m in range(num_microbatches):
            for k in kinds:
                table[s, m, k] = duration(s, m, k)
    return lower_bound_table(placement, table, split_backward)


def forward_flow(F: np.ndarray) -> np.ndarray:
    """Least end of each F(s, m) (stages, microbatches) when every stage runs its forwards in
    microbatch order: after F(s-1, m) and after F(s, m-1) (the flow-shop recurrence)."""
    stages, micro = F.shape
    end = np.zeros_like(F, dtype=np.float64)
    for s in range(stages):
        prev = end[s - 1] if s else np.zeros(micro)
        row, t = end[s], 0.0
        for m in range(micro):
            t = max(t, prev[m]) + F[s, m]
            row[m] = t
    return end


def in_order_bound(placement: Placement, table: np.ndarray, split_backward: bool) -> float:
    """A lower bound for schedules that run each stage's forwards in microbatch order, as every
    library hint does in strict and ready mode (entry forwards are admitted in hint order, so
    they reach every later stage in that order); at least `lower_bound_table`.

    Why: the lower bound takes each rank's head from its fastest microbatch, but a microbatch
    that is slow on every stage (multimodal) delays every one behind it by its extra cost on
    each stage it passes: in a flow shop that keeps the order, the last stage idles about
    (stages - 1) x the slowest forward in total, whatever the policy. Here F(s, m) starts no
    earlier than the flow-shop recurrence allows (after F(s-1, m) and F(s, m-1)), and once it
    has, the rank still has every later-or-equal microbatch's work on stage s and the stages
    after it that it holds, and all their backward pieces, to run one at a time.
    Communication is ignored, as in `lower_bound_table`.
    """
    F, B = table[:, :, Kind.F], table[:, :, Kind.B]
    W = table[:, :, Kind.W] if split_backward else np.zeros_like(F)
    end = forward_flow(F)
    start = end - F
    best = lower_bound_table(placement, table, split_backward)
    for rank in range(placement.num_ranks):
        mine = sorted(placement.stages_of(rank))
        backward = (B[mine] + W[mine]).sum(axis=0)
        for i, s in enumerate(mine):
            per_mb = F[mine[i:]].sum(axis=0) + backward  # work that must follow F(s, m)
            after = np.cumsum(per_mb[::-1])[::-1]  # of microbatches m and later
            best = max(best, float(np.max(start[s] + after)))
    return best
