"""A step's microbatches in another order, on the simulator's durations.

Reordering microbatches (schedulers/order.py) changes which microbatch's durations fill each
slot of the hint, nothing else: the runtime runs slots, so the simulator runs the same code on
the durations permuted along the microbatch axis, per step (each step draws its own sizes).

The permutation comes from `known_costs`: what a real job knows of a microbatch before running
it, its size. Under the jitter models that is the per-microbatch factor shared by every stage
and kind (multimodal: FACTOR for a heavy microbatch, 1 for a light one), the part that the byte
model of sim/memory.py also scales with; never a per-task draw (lognormal terms, the
multimodal noise) nor a measured duration. A trace carries sizes only where it was given them (`Trace(sizes=)`); otherwise its order
stays.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..schedulers.order import ORDERS, cost_order
from ..transports.base import Message, MessageKind
from .durations import Durations
from .variability import JitterModel, StepTables

__all__ = ["known_costs", "Reordered", "reordered", "orders_differ"]


def known_costs(durations: object, step: int) -> list[float] | None:
    """Each microbatch's size factor in `step` (`durations.sizes(step)`: a JitterModel's, a
    Trace's when it was given sizes), or None where the durations carry none."""
    sizes = getattr(durations, "sizes", None)
    values = None if sizes is None else sizes(step)
    return None if values is None else [float(v) for v in values]


class Reordered(StepTables):
    """`durations` with slot i of step s running microbatch `perm(s)[i]`; comm delays too."""

    def __init__(self, durations: Durations, model: JitterModel,
                 perm: Callable[[int], tuple[int, ...]]) -> None:
        super().__init__()
        self.inner, self.model, self.perm = durations, model, perm
        self.placement = durations.placement
        self.num_microbatches = durations.num_microbatches
        self.split_backward = durations.split_backward

    def order(self, step: int) -> tuple[int, ...]:
        return self.perm(step)

    def _compute(self, step: int) -> np.ndarray:
        return self.inner.table(step)[:, list(self.perm(step)), :]

    def delay(self, scale: float = 1e-3) -> Callable[[int, int, Message], float] | None:
        """The model's comm delays, of the microbatch in the message's slot."""
        if not self.model.spec.has_comm:
            return None

        def delay(src: int, dst: int, msg: Message) -> float:
            mb = self.perm(msg.step)[msg.microbatch]
            return scale * self.model.comm_ms(msg.step, msg.stage, mb,
                                              msg.kind is MessageKind.GRADIENT)
        return delay


def reordered(durations: Durations, model: JitterModel, how: str) -> Reordered | None:
    """`durations` in `cost_order(..., how)` of their known costs, or None where that changes
    nothing (the given order, or durations without sizes)."""
    memo: dict[int, tuple[int, ...]] = {}
    stages, split = durations.placement.num_stages, durations.split_backward

    def perm(step: int) -> tuple[int, ...]:
        if step not in memo:
            costs = known_costs(durations, step)
            memo[step] = (cost_order(costs, how, stages, split) if costs
                          else tuple(range(durations.num_microbatches)))
        return memo[step]
    if how == "given" or known_costs(durations, 0) is None:
        return None
    return Reordered(durations, model, perm)


def orders_differ(durations: object, steps: int) -> bool:
    """Whether a cost order would move any microbatch in the first `steps` steps (known sizes
    that are not all equal): only then are reordered candidates worth simulating."""
    n = getattr(durations, "num_microbatches", 0)
    placement = getattr(durations, "placement", None)
    stages = placement.num_stages if placement is not None else 1
    split = getattr(durations, "split_backward", True)
    for step in range(steps):
        costs = known_costs(durations, step)
        if costs and any(cost_order(costs, how, stages, split) != tuple(range(n))
                         for how in ORDERS[1:]):
            return True
    return False
