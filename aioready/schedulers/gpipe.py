"""GPipe (Huang et al., 2019): every forward, then every backward, oldest microbatch first.

With split backward (our reading; GPipe predates it) each W follows its own B directly, so the
order stays a valid sequence and its peak in-flight count is M, as in GPipe.
"""

from __future__ import annotations

from ..hints import HintOrder
from ..placement import Placement
from ..tasks import Kind, Task

__all__ = ["gpipe"]


def gpipe(placement: Placement, num_microbatches: int, *, split_backward: bool) -> HintOrder:
    if placement.num_chunks != 1:
        from ..errors import HintError
        raise HintError("gpipe runs one chunk per rank", expected="linear placement",
                        got=placement.style)
    M = num_microbatches
    order = [Task(Kind.F, m) for m in range(M)]
    for m in range(M):
        order.append(Task(Kind.B, m))
        if split_backward:
            order.append(Task(Kind.W, m))
    return HintOrder("gpipe", placement, M, split_backward,
                     tuple(tuple(order) for _ in range(placement.num_ranks)))
