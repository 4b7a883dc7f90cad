"""Interleaved 1F1B (Megatron-LM virtual pipeline stages; Narayanan et al., SC'21) and the
warmup / steady 1F1B / cooldown core that ZB-H1 shares with it.

From the paper and Megatron (docs/hints.md "Textbook figures", Megatron-LM issues #169, #675): rank
r holds v chunks, chunk c = stage c*R + r; microbatches go through in rounds; a rank warms up with
(v-1)*round + 2*(R-1-r) forwards, then alternates one forward and one backward, then drains.
Our reading, as torch 2.13's ScheduleInterleaved1F1B realizes it (reproduced literally for R=4,
M=8 in the tests, docs/hints.md "Reference orders"): a round is M // max(1, M // R) microbatches (M
must split into rounds); the k-th forward of a rank runs chunk (k // round) mod v and the k-th
backward chunk v-1 - (k // round) mod v, each on that chunk's next microbatch. With split backward,
W either follows its B at once, or (zero bubble, `w_delay=d`) the first W comes in the d-th
backward step and each later step runs the W of the oldest pending B (ZB-H1, ZB paper 2.1:
"W of rank r delayed by r steps"; torch's InterleavedZeroBubble uses the same rule).
"""

from __future__ import annotations

from collections import deque

from ..errors import HintError
from ..hints import HintOrder
from ..placement import Placement
from ..tasks import Kind, Task

__all__ = ["interleaved_1f1b", "interleaved_zb", "steady_order", "round_size"]


def round_size(num_ranks: int, num_microbatches: int) -> int:
    """Microbatches per round: M split into max(1, M // R) equal rounds."""
    rounds = max(1, num_microbatches // num_ranks)
    if num_microbatches % rounds:
        raise HintError(
            "interleaved schedules need the microbatches to split into equal rounds",
            expected=f"a multiple of {rounds} rounds (max(1, M // R) with R={num_ranks})",
            got=f"microbatches={num_microbatches}")
    return num_microbatches // rounds


def steady_order(*, num_chunks: int, num_microbatches: int, warmup: int, per_round: int,
                 split_backward: bool, w_delay: int | None) -> list[Task]:
    """One rank's order: `warmup` forwards, then F/B pairs, then the remaining B's (and W's)."""
    v, M = num_chunks, num_microbatches
    total = v * M
    warmup = min(warmup, total)
    next_f = [0] * v
    next_b = [0] * v
    pending_w: deque[Task] = deque()
    order: list[Task] = []

    def forward(k: int) -> None:
        chunk = (k // per_round) % v
        order.append(Task(Kind.F, next_f[chunk], chunk))
        next_f[chunk] += 1

    def backward(j: int) -> None:
        chunk = v - 1 - (j // per_round) % v
        task = Task(Kind.B, next_b[chunk], chunk)
        next_b[chunk] += 1
        order.append(task)
        if not split_backward:
            return
        pending_w.append(Task(Kind.W, task.microbatch, chunk))
        if w_delay is None or j >= w_delay:
            order.append(pending_w.popleft())

    for k in range(warmup):
        forward(k)
    for j in range(total - warmup):
        forward(warmup + j)
        backward(j)
    for j in range(total - warmup, total):
        backward(j)
    order.extend(pending_w)
    return order


def _build(name: str, placement: Placement, M: int, split: bool, zero_bubble: bool) -> HintOrder:
    # Warmup: (v-1) rounds plus 2 per hop from the last rank (1 per hop for zero bubble, whose
    # W's fill the gap the extra forwards would otherwise fill; torch 2.13 does the same).
    if placement.style != "interleaved":
        raise HintError(f"{name} needs the interleaved placement", expected="interleaved",
                        got=placement.style)
    R, v = placement.num_ranks, placement.num_chunks
    per_round = round_size(R, M)
    orders = tuple(
        tuple(steady_order(num_chunks=v, num_microbatches=M,
                           warmup=(v - 1) * per_round + (1 if zero_bubble else 2) * (R - 1 - r), per_round=per_round,
                           split_backward=split, w_delay=r if zero_bubble else None))
        for r in range(R))
    return HintOrder(name, placement, M, split, orders)


def interleaved_1f1b(placement: Placement, num_microbatches: int, *,
                     split_backward: bool) -> HintOrder:
    """Megatron VPP / torch ScheduleInterleaved1F1B; with split backward W follows its B."""
    return _build("interleaved-1f1b", placement, num_microbatches, split_backward, False)


def interleaved_zb(placement: Placement, num_microbatches: int, *,
                   split_backward: bool) -> HintOrder:
    """ZB1P on the interleaved placement (torch ScheduleInterleavedZeroBubble's order)."""
    if not split_backward:
        raise HintError("interleaved-zb needs split backward", expected="split_backward=True",
                        got="split_backward=False")
    return _build("interleaved-zb", placement, num_microbatches, True, True)
