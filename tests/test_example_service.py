"""examples/service.py answers /status and /metrics while a training step is in progress."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

ROOT = Path(__file__).resolve().parents[1]


def load_service():  # examples/ is not a package: load the file as a module
    spec = importlib.util.spec_from_file_location("aioready_example_service",
                                                  ROOT / "examples" / "service.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(90)
async def test_service_answers_status_during_a_step() -> None:
    from aiohttp import ClientSession, web
    svc = load_service()
    # 4 stages x 4 microbatches of 20/40 ms tasks: a step lasts about 0.4 s
    trainer = svc.Trainer(stages=4, microbatches=4, steps=2, task_ms=20.0)
    runner = web.AppRunner(svc.make_app(trainer))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with ClientSession() as http:
            during = []
            for _ in range(400):
                async with http.get(f"http://127.0.0.1:{port}/status") as resp:
                    assert resp.status == 200
                    body = json.loads(await resp.text())
                if body["in_step"]:
                    during.append(body)
                    if len(during) >= 3:
                        break
                await asyncio.sleep(0.01)
            assert len(during) >= 3, "no /status answer arrived while a step was running"
            assert body["error"] is None
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
            assert "aioready_tasks_total" in text and "aioready_activations_in_flight" in text
            for _ in range(600):  # let the training finish: losses are real numbers
                if trainer.step == 2 or trainer.error:
                    break
                await asyncio.sleep(0.05)
            assert trainer.error is None and trainer.step == 2
            assert trainer.loss is not None and trainer.loss > 0
    finally:
        await runner.cleanup()
