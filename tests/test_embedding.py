"""`await pipe.step(...)` inside an already-running loop that does other work (a service)."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

import aioready
from aioready.testing.helpers import make_mlp_stages, mse_loss


class AsksTheLoop(torch.nn.Module):
    """A stage whose first forward (on the compute thread) asks the service on the loop for an
    answer and waits for it: a loop that a running task blocked could never answer."""

    def __init__(self, inner: torch.nn.Module, loop: asyncio.AbstractEventLoop,
                 asked: asyncio.Event) -> None:
        super().__init__()
        self.inner, self.loop, self.asked = inner, loop, asked
        self.answer = threading.Event()
        self.answered: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.answered is None:
            self.loop.call_soon_threadsafe(self.asked.set)
            self.answered = self.answer.wait(60)
        return self.inner(x)


async def test_other_work_keeps_running_during_a_step() -> None:
    loop = asyncio.get_running_loop()
    asked = asyncio.Event()
    answered_at: list[float] = []
    stages = make_mlp_stages(2, width=128, hidden=512, blocks_per_stage=3, dtype=torch.float32)
    first = AsksTheLoop(stages[0], loop, asked)

    async def service_work() -> None:
        await asked.wait()
        answered_at.append(time.monotonic())  # the clock spans use on a real loop
        first.answer.set()

    service = asyncio.create_task(service_work())
    pipe = aioready.Pipeline([first, stages[1]], mse_loss, microbatches=4, hint="1f1b",
                             mode="ready")
    x, y = torch.randn(256, 128), torch.randn(256, 128)
    loss = await pipe.step(x, y)
    await service
    pipe.close()
    assert loss is not None and torch.isfinite(loss)
    assert first.answered, "the loop never ran other work while a task was computing"
    f0 = next(s for s in pipe.last_step.spans if s.label == "F0" and s.stage == 0)
    assert f0.start < answered_at[0] < f0.end  # answered inside the task that asked
    # the loop was not replaced or closed by the library
    assert asyncio.get_running_loop() is loop and not loop.is_closed()
