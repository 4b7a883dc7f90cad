"""`await pipe.step(...)` inside an already-running loop that does other work (a service)."""

from __future__ import annotations

import asyncio
import time

import torch

import aioready
from aioready.testing.helpers import make_mlp_stages, mse_loss


async def test_other_work_keeps_running_during_a_step() -> None:
    loop = asyncio.get_running_loop()
    ticks: list[float] = []
    stop = asyncio.Event()

    async def service_work() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())  # the clock spans use on a real loop
            await asyncio.sleep(0.001)

    ticker = asyncio.create_task(service_work())
    await asyncio.sleep(0.01)
    stages = make_mlp_stages(2, width=128, hidden=512, blocks_per_stage=3, dtype=torch.float32)
    pipe = aioready.Pipeline(stages, mse_loss, microbatches=4, hint="1f1b", mode="ready")
    x, y = torch.randn(256, 128), torch.randn(256, 128)
    loss = await pipe.step(x, y)
    stop.set()
    await ticker
    pipe.close()
    assert loss is not None and torch.isfinite(loss)
    report = pipe.last_step
    during = [t for t in ticks if report.start <= t <= report.end]
    assert len(during) >= 3, f"only {len(during)} ticks of other work during the step"
    inside_tasks = [t for t in during
                    if any(s.start < t < s.end for s in report.spans)]
    assert inside_tasks, "the loop never ran other work while a task was computing"
    # the loop was not replaced or closed by the library
    assert asyncio.get_running_loop() is loop and not loop.is_closed()
