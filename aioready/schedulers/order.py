"""The order microbatches enter the pipeline in, from a cost known before the step.

Every hint ranks microbatch *slots* 0..M-1; which microbatch fills which slot is free, since a
step's gradients are the sum over its microbatches. With one slot order for all, a heavy microbatch
early leads a convoy: every stage runs forwards in slot order, so the light ones behind it move at
its pace (docs/policy_measurements.md "Where the time goes at twice the memory"). What a step
cannot avoid is the fill, slot 0's forward chain down the stages before the last one has work, and
the drain, the last slot's backward chain back up; both are paid at that slot's microbatch's cost.
The offline optimum (bench/optimum.py) starts with light microbatches and ends with one
(docs/policy.md "The microbatch order"). Both orders here put the lightest microbatch last (the
drain runs backward pieces, the longer ones) and a light one first:

- "ascending": the others lightest first, so the heavy ones come just before the last. Light
  microbatches fill the pipeline fast and none waits behind a heavy one until the end.
- "descending": the next lightest first, then the others heaviest first: a heavy microbatch's
  long round trip overlaps the others' work. It wins where microbatches are few per stage
  (S=4, M=16 unsplit), "ascending" where they are many (S >= 8, 2S in flight).
- "middle": the heavy ones in the middle, between two runs of light ones: the 3S/2 lightest
  (S stages) last, lightest at the very end, the rest before them lightest first. It is
  "ascending" with a longer light tail: after the last heavy microbatch enters, enough light
  ones follow it to keep every stage busy while its long round trip (S stages down, S back up)
  drains, instead of the drain waiting on it. The optimum's schedules have this shape too.
  The tail's length is the one measured shape parameter (S, 3S/2, 2S tried;
  docs/policy_measurements.md "The microbatch order"), so it needs the number of stages, and
  whether the backward is split: an unsplit backward (its weight gradient runs with it, nothing to
  defer into the drain) sends each microbatch back up through a longer chain, and its best tail is
  7S/4 ("An unsplit backward's tail" there).

None wins everywhere, so `hint="auto"` simulates each next to the given order.

The cost is what the caller knows before running the microbatch (its size: tokens, images,
bytes), never a measured duration of this step. Equal costs keep their given order, so
`cost_order` of equal costs is the identity.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..errors import ConfigError

__all__ = ["ORDERS", "TAIL", "TAIL_UNSPLIT", "cost_order", "check_costs"]

ORDERS = ("given", "ascending", "descending", "middle")
"""Microbatch orders: as given, or `cost_order` of the known costs in one of three shapes
(new ones go last: a choice crosses MPI as an index into this tuple)."""

TAIL = 1.5
""""middle": light microbatches after the heavy ones, per stage, with a split backward
(chosen on seeds 0-4)."""

TAIL_UNSPLIT = 1.75
"""The same with an unsplit backward (chosen on seeds 0-4, S = 4, 8, 16)."""


def check_costs(costs: Sequence[float], num_microbatches: int) -> list[float]:
    """The costs as floats, or ConfigError naming what is wrong."""
    values = list(costs)
    if len(values) != num_microbatches:
        raise ConfigError("costs: one per microbatch", expected=f"{num_microbatches} costs",
                          got=f"{len(values)}")
    out = []
    for i, value in enumerate(values):
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"costs[{i}] is not a number", expected="a finite number >= 0",
                              got=repr(value)) from None
        if not (math.isfinite(number) and number >= 0):
            raise ConfigError(f"costs[{i}] must be a finite number >= 0",
                              expected="a finite number >= 0", got=repr(value))
        out.append(number)
    return out


def cost_order(costs: Sequence[float], how: str = "ascending",
               stages: int | None = None, split_backward: bool = True) -> tuple[int, ...]:
    """Slot i runs microbatch `cost_order(costs)[i]` (module note for `how`; "middle" needs the
    pipeline's number of `stages`, and its tail follows `split_backward`). Ties keep the given
    order; equal costs give the identity."""
    if how not in ORDERS:
        raise ConfigError("microbatch order", expected=" | ".join(ORDERS), got=repr(how))
    if how == "middle" and not (isinstance(stages, int) and stages >= 1):
        raise ConfigError("microbatch order 'middle' needs the number of stages",
                          expected="stages: an int >= 1", got=repr(stages))
    n = len(costs)
    if how == "given" or n < 3 or max(costs) == min(costs):
        return tuple(range(n))
    light = sorted(range(n), key=lambda m: (costs[m], m))
    if how in ("ascending", "middle"):
        per_stage = TAIL if split_backward else TAIL_UNSPLIT
        tail = 1 if how == "ascending" else min(n - 1, math.ceil(per_stage * stages))  # type: ignore[operator]
        return (*light[tail:], *reversed(light[:tail]))
    middle = sorted(light[2:], key=lambda m: (-costs[m], m))
    return (light[1], *middle, light[0])
