"""The step driver: every rank of this process through one step, for Pipeline and the simulator.

In-process pipelines and the simulator hold one RankRuntime per rank; under MPI a process holds
one. The ranks of a step run concurrently in one TaskGroup, so when one fails the others are
cancelled rather than left waiting for messages that will never come, and the caller sees the
error that started it, not the cancellations it caused.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from .rank import RankRuntime

__all__ = ["run_ranks"]


async def run_ranks(runtimes: Sequence[RankRuntime], step: int, inputs: Any = None,
                    targets: Any = None) -> Any:
    """Run `step` on every runtime; return the loss where the last stage lives, else None.

    `inputs` and `targets` are the step's microbatches (each rank takes what its stages need).
    """
    if len(runtimes) == 1:
        return await runtimes[0].run_step(step, inputs, targets)
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(rt.run_step(step, inputs, targets)) for rt in runtimes]
    except BaseExceptionGroup as errors:
        raise _first_cause(errors) from None
    losses = [t.result() for t in tasks]
    return next((loss for loss in reversed(losses) if loss is not None), None)


def _first_cause(group: BaseExceptionGroup) -> BaseException:
    """The first real error of a failed step (the others are its consequences)."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_cause(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]
