"""An asyncio HTTP service that trains a pipeline in the background and answers while it trains.

    python examples/service.py --port 8080 --steps 100
    curl localhost:8080/status      # {"step": 12, "in_step": true, "loss": 3.9, ...}
    curl localhost:8080/metrics     # Prometheus text: busy fraction, step time, tasks, bytes...
    python examples/service.py --dashboard 8050   # and a live page on http://127.0.0.1:8050/

The training loop is a plain task on the service's event loop: `await pipe.step(...)` yields to
the loop whenever it waits (for a device, a message), so /status answers during a step. Tasks are
paced (each takes at least --task-ms) so a step lasts long enough to watch.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import torch
from aiohttp import web

import aioready
from aioready.cli.trainer import synthetic_microbatch
from aioready.devices.cpu import CPUDevice
from aioready.devices.paced import PacedDevice
from aioready.sim.durations import paced_duration
from aioready.telemetry.instruments import Instruments, instrument_pipeline
from aioready.telemetry.metrics import step_metrics
from aioready.telemetry.prometheus import PrometheusInstrument
from aioready.testing.models import gpt_stages, lm_loss


class Trainer:
    """The background training job and what /status reports about it."""

    def __init__(self, *, stages: int = 4, microbatches: int = 4, steps: int = 100,
                 task_ms: float = 20.0, mode: str = "ready", jitter: str = "none",
                 dashboard: int | None = None) -> None:
        self.steps, self.microbatches = steps, microbatches
        self.model = gpt_stages(stages, vocab=64, dim=32, heads=2, seq=32)
        duration, _ = paced_duration(placement=aioready.Placement.linear(stages),
                                     num_microbatches=microbatches, split_backward=False,
                                     task_ms=task_ms, jitter=jitter)
        self.pipe = aioready.Pipeline(
            self.model, lm_loss, microbatches=microbatches, hint="1f1b", mode=mode,
            device=lambda rank: PacedDevice(CPUDevice(f"svc-rank{rank}"), duration),
            dashboard=dashboard)
        self.prom = PrometheusInstrument()
        self.instruments = Instruments([self.prom])
        instrument_pipeline(self.pipe, self.instruments)
        self.opt = torch.optim.AdamW([p for m in self.model for p in m.parameters()], lr=3e-3)
        self.step = 0
        self.in_step = False
        self.loss: float | None = None
        self.last_step_ms: float | None = None
        self.efficiency: float | None = None
        self.error: str | None = None

    async def run(self) -> None:
        try:
            for step in range(self.steps):
                pairs = [synthetic_microbatch(step, m, batch=2, seq=32, vocab=64)
                         for m in range(self.microbatches)]
                self.in_step = True
                loss = await self.pipe.step([x for x, _ in pairs], [y for _, y in pairs])
                self.in_step = False
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                report = self.pipe.last_step
                assert report is not None
                metrics = step_metrics(report)
                self.instruments.call("after_step", report, metrics)
                self.step, self.loss = step + 1, float(loss)
                self.last_step_ms, self.efficiency = metrics.step_time * 1e3, metrics.efficiency
        except Exception as exc:  # reported on /status; the service keeps answering
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.in_step = False
            self.pipe.close()

    def status(self) -> dict[str, Any]:
        return {"step": self.step, "steps": self.steps, "in_step": self.in_step,
                "loss": self.loss, "last_step_ms": self.last_step_ms,
                "efficiency": self.efficiency, "error": self.error, "time": time.time()}


TRAINING = web.AppKey("training", asyncio.Task)


def make_app(trainer: Trainer) -> web.Application:
    async def status(_: web.Request) -> web.Response:
        return web.json_response(trainer.status())

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=trainer.prom.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    async def start_training(app: web.Application) -> Any:
        app[TRAINING] = asyncio.get_running_loop().create_task(trainer.run())
        yield
        app[TRAINING].cancel()
        await asyncio.gather(app[TRAINING], return_exceptions=True)

    app = web.Application()
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.cleanup_ctx.append(start_training)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--task-ms", type=float, default=20.0)
    p.add_argument("--mode", choices=("ready", "strict"), default="ready")
    p.add_argument("--dashboard", type=int, default=None, metavar="PORT",
                   help="also serve the live dashboard on this port")
    a = p.parse_args()
    torch.set_num_threads(1)
    trainer = Trainer(steps=a.steps, task_ms=a.task_ms, mode=a.mode, dashboard=a.dashboard)
    if trainer.pipe.dashboard is not None:
        print(f"dashboard on {trainer.pipe.dashboard.url}")

    async def serve() -> None:
        runner = web.AppRunner(make_app(trainer))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", a.port).start()
        print(f"serving http://127.0.0.1:{a.port}/status and /metrics; Ctrl-C to stop")
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
    aioready.run(serve())


if __name__ == "__main__":
    main()
