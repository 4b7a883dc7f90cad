"""Two lower bounds on one pipeline step, tighter than telemetry.bounds where it matters at
S=128 (docs/policy_measurements.md "The true limit at S=128"). Benchmark helpers, not library
code.

`memory_bound` (any schedule within per-rank caps): telemetry.bounds.lower_bound_table lets a
split backward's W fill the gradient's way back to stage 0 (the tail) on every rank. But W can
only wait while its microbatch stays held, so a rank with a small cap (the last ones under
2(S - r)) cannot keep enough W for the tail: the tail comes back. Exact (1789 against the greedy
list schedule's 1789) on S=128, M=512 without jitter under 2(S - r), where the lower bound says
1663.

`in_order_rank_bound` (any schedule, any memory, that runs each stage's forwards in microbatch
order, as every hint does under strict, greedy and reserve): the one-machine relaxation of each
rank with release dates. telemetry.bounds.in_order_bound counts, after F(s, m), only the work of
microbatches m and later; but the backward pieces of the earlier ones cannot start before their
gradient can have come back from the last stage, so they too are left after a point in time.

`head_tail_bound` (any schedule, any memory, any order): the one-machine bound with heads and
tails per task. The lower bound charges every rank the least head and the least tail over all
microbatches; under jitter those come from different microbatches, and each is far below the
typical one. Here each task keeps its own: a head (the least time before it can start, its
dependency chain from the step's start) and a tail (the least time from its end to the step's
end, its chain to stage 0's last piece). For any set J of one rank's tasks the step lasts at
least min head(J) + sum p(J) + min tail(J) (the last of J to end on the rank ends no earlier
than the first head plus all their work, and its own tail follows); the bound takes the best J
of the form {head >= x, tail >= y}, which is where the maximum lies (the preemptive
one-machine bound with release and delivery times).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from aioready.placement import Placement
from aioready.tasks import Kind
from aioready.telemetry.bounds import forward_flow, in_order_bound, lower_bound_table

__all__ = ["memory_bound", "in_order_rank_bound", "head_tail_bound", "forward_flow"]


def memory_bound(placement: Placement, table: np.ndarray, split_backward: bool,
                 caps: Sequence[int]) -> float:
    """A lower bound on any schedule that respects `caps` (the module's note); at least telemetry.bounds.lower_bound_table. Communication is ignored (a delay only
    lengthens a schedule), so it holds with it too.

    On rank r, once its last backward B ends (at b), only weight gradients are left, and each
    belongs to a microbatch the rank still holds: at most caps[r] microbatches, so at most the
    caps[r] largest per-microbatch W sums. The rank started no earlier than its head, and runs
    one task at a time, so b >= head + busy - those W. Before its first B starts only forwards
    ran, of at most caps[r] admitted microbatches (nothing is released before a backward), so
    also b >= reach + busy - the largest F sums - the largest W sums, where reach is the least
    time a gradient can reach r. After b the gradient of that microbatch still has to travel
    down to stage 0 (and run stage 0's W there): the tail.
    """
    F, B = table[:, :, Kind.F], table[:, :, Kind.B]
    W = table[:, :, Kind.W] if split_backward else np.zeros_like(F)
    before_f = np.vstack([np.zeros((1, F.shape[1])), np.cumsum(F, axis=0)])  # F of < s
    before_b = np.vstack([np.zeros((1, B.shape[1])), np.cumsum(B, axis=0)])  # B of < s
    after_b = B.sum(axis=0) - before_b[1:]  # B of stages > s, per (s, m)
    best = lower_bound_table(placement, table, split_backward)
    for rank in range(placement.num_ranks):
        stages = list(placement.stages_of(rank))
        cap = int(caps[rank])
        busy = float(table[stages][:, :, :3 if split_backward else 2].sum())
        head = float(before_f[stages].min())
        reach = float((F.sum(axis=0) + after_b[stages]).min())
        tails = [before_b[s] + W[0] if s > 0 else np.zeros(F.shape[1]) for s in stages]
        tail = float(np.min(tails))
        top_w = float(np.sort(W[stages].sum(axis=0))[::-1][:cap].sum())
        top_f = float(np.sort(F[stages].sum(axis=0))[::-1][:cap].sum())
        best = max(best, max(head + busy - top_w, reach + busy - top_f - top_w) + tail)
    return best


def in_order_rank_bound(table: np.ndarray, split_backward: bool) -> float:
    """A lower bound on any schedule of a linear placement (rank s holds stage s) that runs each
    stage's forwards in microbatch order, whatever the memory; at least in_order_bound there.

    Each task gets a release date it cannot start before, in every such schedule: F(s, m) the
    flow-shop start (`forward_flow`); B(s, m) the least end of F(S-1, m) plus the backwards of
    the stages after s (its gradient's way back); W(s, m) that plus B(s, m). A rank runs one task
    at a time, so for every time x the tasks released at or after x end no earlier than x plus
    their total duration: the step lasts at least max over x of that (exact for one machine with
    release dates). Communication is ignored (it only delays). At least
    telemetry.bounds.in_order_bound, whose value it starts from."""
    F, B = table[:, :, Kind.F], table[:, :, Kind.B]
    W = table[:, :, Kind.W] if split_backward else np.zeros_like(F)
    end = forward_flow(F)
    back = np.maximum(end[-1][None, :] + B.sum(axis=0) - np.cumsum(B, axis=0), end)
    best = in_order_bound(Placement.linear(F.shape[0]), table, split_backward)
    for s in range(F.shape[0]):
        release = np.concatenate([end[s] - F[s], back[s], back[s] + B[s]])
        work = np.concatenate([F[s], B[s], W[s]])
        order = np.argsort(-release, kind="stable")
        best = max(best, float(np.max(release[order] + np.cumsum(work[order]))))
    return best


def head_tail_bound(table: np.ndarray, split_backward: bool) -> float:
    """A lower bound on any schedule of a linear placement (rank s holds stage s), any memory
    and any order (the module's note); at least telemetry.bounds.lower_bound_table there.

    Heads: F(s, m) the forwards of stages < s; B(s, m) every forward and the backwards of stages
    > s; W(s, m) that plus B(s, m). Tails: F(s, m) every later piece of its microbatch's chain
    (the forwards after s, every backward, stage 0's W); B(s, m) the backwards before s and stage
    0's W (split: at least its own W); W(s, m) none. Communication is ignored (it only delays).
    """
    F, B = table[:, :, Kind.F], table[:, :, Kind.B]
    W = table[:, :, Kind.W] if split_backward else np.zeros_like(F)
    S = F.shape[0]
    before_f = np.cumsum(F, axis=0) - F
    after_f = F.sum(axis=0) - np.cumsum(F, axis=0)
    before_b = np.cumsum(B, axis=0) - B
    after_b = B.sum(axis=0) - np.cumsum(B, axis=0)
    back = F.sum(axis=0) + after_b  # the head of B(s, m)
    b_tail = np.where(np.arange(S)[:, None] > 0, before_b + W[0], 0.0)
    b_tail = np.maximum(b_tail, W)
    best = lower_bound_table(Placement.linear(S), table, split_backward)
    for s in range(S):
        heads = [before_f[s], back[s]] + ([back[s] + B[s]] if split_backward else [])
        tails = [after_f[s] + B.sum(axis=0) + W[0], b_tail[s]] + (
            [np.zeros_like(W[s])] if split_backward else [])
        work = [F[s], B[s]] + ([W[s]] if split_backward else [])
        best = max(best, _one_machine(np.concatenate(heads), np.concatenate(work),
                                      np.concatenate(tails)))
    return best


def _one_machine(head: np.ndarray, work: np.ndarray, tail: np.ndarray) -> float:
    """max over x, y of x + (work of the tasks with head >= x and tail >= y) + y."""
    best = 0.0
    for x in np.unique(head):
        keep = head >= x
        t, p = tail[keep], work[keep]
        order = np.argsort(-t, kind="stable")
        best = max(best, float(x + np.max(np.cumsum(p[order]) + t[order])))
    return best
