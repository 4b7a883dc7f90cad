"""`--metrics-port`: the Prometheus endpoint answers with the named metrics during a run."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import pytest

pytest.importorskip("prometheus_client")

from aioready.cli.trainer import TrainConfig, train  # noqa: E402
from aioready.telemetry.prometheus import METRIC_NAMES  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def value(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name + labels + " ") or line.startswith(name + labels + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not in the exposition")


@pytest.mark.timeout(90)
async def test_metrics_endpoint_answers_during_a_run() -> None:
    port = free_port()
    cfg = TrainConfig(stages=2, microbatches=4, steps=3, task_ms=15.0, metrics_port=port,
                      dim=16, seq=16)
    loop = asyncio.get_running_loop()
    run = loop.create_task(train(cfg))
    seen: list[str] = []
    while not run.done():
        try:
            text = await loop.run_in_executor(None, scrape, port)
        except OSError:
            await asyncio.sleep(0.02)  # the server is not up yet
            continue
        seen.append(text)
        await asyncio.sleep(0.05)
    result = run.result()
    assert len(result.metrics) == 3
    assert seen, "the endpoint never answered during the run"
    last = seen[-1]
    for name in METRIC_NAMES:
        assert f"# TYPE {name.removesuffix('_total')}" in last, name
    # tasks counted live: 2 ranks x 4 microbatches x (F, B) per finished step at least
    assert value(last, "aioready_tasks_total", '{kind="F",rank="0"}') >= 4
    assert value(last, "aioready_messages_sent_total", '{rank="0"}') >= 4
    assert value(last, "aioready_bytes_sent_total", '{rank="0"}') > 0
    mid = [t for t in seen if "aioready_steps_total 1.0" in t or "aioready_steps_total 2.0" in t]
    assert mid, "no scrape landed between steps"
    assert 0 < value(mid[-1], "aioready_busy_fraction", '{rank="1"}') <= 1
