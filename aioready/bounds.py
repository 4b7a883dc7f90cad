"""The lower bound of a step's time, from its realized task durations (DESIGN.md "Variability").

    LB = max(longest dependency chain, max over ranks r of (head_r + busy_r + tail_r))

`busy_r` is the sum of rank r's task durations; `head_r` the least time any microbatch needs to
reach r's first stage (F on the stages before it); `tail_r`, for unsplit backward only, the least
time a gradient needs from r's first stage back to stage 0 (B on the stages before it; 0 with split
backward, since W can fill it). Communication is ignored. With no jitter this makes 1F1B and GPipe
exactly 1.0 efficient. Efficiency = LB / measured step time.

It lives in its own torch-free module so that the simulator (sim.py) and telemetry share one
definition; `aioready.sim.lower_bound` is this function.
"""

from __future__ import annotations

from typing import Callable

from .placement import Placement
from .tasks import Kind

__all__ = ["lower_bound", "DurationOf"]

DurationOf = Callable[[int, int, Kind], float]  # (stage, microbatch, kind) -> duration


def lower_bound(placement: Placement, num_microbatches: int, split_backward: bool,
                duration: DurationOf) -> float:
    """The lower bound of one step's time given each task's duration (any time unit)."""
    S, M = placement.num_stages, num_microbatches
    f = [[duration(s, m, Kind.F) for m in range(M)] for s in range(S)]
    b = [[duration(s, m, Kind.B) for m in range(M)] for s in range(S)]
    w = [[duration(s, m, Kind.W) for m in range(M)] for s in range(S)] if split_backward else None
    chain = 0.0
    for m in range(M):
        t = sum(f[s][m] for s in range(S))
        for s in reversed(range(S)):
            t += b[s][m]
            chain = max(chain, t + (w[s][m] if w is not None else 0.0))
    bound = chain
    for r in range(placement.num_ranks):
        stages = placement.stages_of(r)
        first = min(stages)
        busy = sum(f[s][m] + b[s][m] + (w[s][m] if w is not None else 0.0)
                   for s in stages for m in range(M))
        head = min(sum(f[s][m] for s in range(first)) for m in range(M))
        tail = 0.0 if split_backward else min(sum(b[s][m] for s in range(first))
                                              for m in range(M))
        bound = max(bound, head + busy + tail)
    return bound
