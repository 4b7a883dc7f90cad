"""In-process TP x PP grids for tests: every (pipeline rank, TP rank) is a RankRuntime on one loop.

Pipeline lines (same TP rank) share an InprocWorld for activations and gradients; TP groups
(same pipeline rank) share another for the leader's decisions.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

from aioready.devices.base import Device
from aioready.hints import HintOrder
from aioready.runtime.rank import RankRuntime
from aioready.tp.coordination import Coordinator
from aioready.transports.inproc import InprocWorld

__all__ = ["Grid"]


class Grid:
    """`runtimes[p][t]`: pipeline rank p, TP rank t."""

    def __init__(self, hint: HintOrder, tp: int, *, mode: str, cap: int | None,
                 device: Callable[[int, int], Device],
                 executors: Callable[[int, int], Sequence[Any] | None] = lambda p, t: None,
                 coordinate: bool = True, **coordinator_options: Any) -> None:
        pp = hint.placement.num_ranks
        self.pp, self.tp = pp, tp
        self.pp_worlds = [InprocWorld(pp) for _ in range(tp)]
        self.tp_worlds = [InprocWorld(tp) for _ in range(pp)]
        self.coordinators = [[Coordinator(self.tp_worlds[p].endpoint(t), **coordinator_options)
                              if coordinate else None
                              for t in range(tp)] for p in range(pp)]
        self.runtimes = [[RankRuntime(rank=p, hint=hint, mode=mode, cap=cap,
                                      executors=executors(p, t), device=device(p, t),
                                      transport=self.pp_worlds[t].endpoint(p),
                                      coordinator=self.coordinators[p][t])
                          for t in range(tp)] for p in range(pp)]

    async def step(self, step: int, inputs: Sequence[Any] | None = None,
                   targets: Sequence[Any] | None = None) -> list[list[Any]]:
        async def one(p: int, t: int) -> Any:
            return await self.runtimes[p][t].run_step(step, inputs if p == 0 else None,
                                                      targets if p == self.pp - 1 else None)
        coros = [one(p, t) for p in range(self.pp) for t in range(self.tp)]
        flat = await asyncio.gather(*coros)
        return [flat[p * self.tp:(p + 1) * self.tp] for p in range(self.pp)]

    def order(self, p: int, t: int, step: int = -1) -> list[str]:
        return self.runtimes[p][t].reports[step].order(p)

    @property
    def num_decision_messages(self) -> int:
        return sum(w.num_messages for w in self.tp_worlds)
