"""`aioready advise`: a recorded run built to have one right answer (one stage twice as slow, so
moving layers is the fix) gets it, and the predicted step time is within 5 % of running that
change: real layers re-split into stages, a Pipeline in-process on the virtual clock."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import aioready
from aioready.cli import main
from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.sim.advise import Recording, advise, message_latency_ms
from aioready.telemetry.export import write_chrome_trace, write_csv, write_parquet
from aioready.testing.helpers import mse_loss

S, M, L, WIDTH = 4, 8, 4, 8
COST = [2.0 if L <= i < 2 * L else 1.0 for i in range(S * L)]  # stage 1's layers: twice as slow


def _wobble(step: int, stage: int, mb: int, kind: int) -> float:
    """A few per cent of deterministic jitter, so the per-layer estimate is not exact."""
    return 1.0 + 0.04 * math.sin(1.7 * step + 2.3 * stage + 0.9 * mb + 3.1 * kind)


def _run(balance: list[int], steps: int = 2) -> list[aioready.telemetry.StepReport]:
    """Real linear layers split by `balance`; a task lasts its layers' cost (x2 for B)."""
    gen = torch.Generator().manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH, dtype=torch.float64) for _ in range(S * L)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.randn(WIDTH, WIDTH, generator=gen) * 0.3)
    edges = [sum(balance[:s]) for s in range(S + 1)]
    stages = [nn.Sequential(*layers[edges[s]:edges[s + 1]]) for s in range(S)]
    stage_cost = [sum(COST[edges[s]:edges[s + 1]]) for s in range(S)]

    def duration(info):  # type: ignore[no-untyped-def]
        factor = 1.0 if info.kind is aioready.tasks.Kind.F else 2.0
        return stage_cost[info.stage] * factor * _wobble(info.step, info.stage, info.microbatch,
                                                          int(info.kind))

    async def go() -> list[aioready.telemetry.StepReport]:
        pipe = aioready.Pipeline(stages, mse_loss, microbatches=M,
                                 device=SimDevice(duration, run_compute=True))
        out = []
        for _ in range(steps):
            xs = torch.randn(M * 2, WIDTH, generator=gen, dtype=torch.float64)
            await pipe.step(xs, torch.zeros_like(xs))
            out.append(pipe.last_step)
        return out
    return run_virtual(go())


def test_advise_moves_layers_off_the_slow_stage_and_predicts_the_result() -> None:
    recorded = _run([L] * S)
    advice = advise(Recording(tuple(recorded), unit_ms=1.0, layers_per_stage=(L,) * S))
    assert advice.best.kind == "layers", advice.table()
    counts = advice.best.change["layers_per_stage"]
    assert counts[1] < L and sum(counts) == S * L  # layers leave the slow stage
    assert advice.best.step_time < 0.9 * advice.now.step_time
    kinds = {o.kind for o in advice.options}
    assert {"hint", "memory", "microbatches", "layers"} <= kinds
    assert "latency" not in kinds  # in-process on the virtual clock: no message latency
    actual = _run(counts)
    measured = sum(r.step_time for r in actual) / len(actual)
    assert abs(advice.best.step_time - measured) <= 0.05 * measured, (advice.best, measured)
    # the simulated present replays the recording
    recorded_mean = sum(r.step_time for r in recorded) / len(recorded)
    assert advice.now.step_time == pytest.approx(recorded_mean, rel=1e-9)
    assert advice.recorded_step_time == pytest.approx(recorded_mean, rel=1e-9)


def test_latency_is_read_from_the_spans() -> None:
    recorded = _run([L] * S, steps=1)
    assert message_latency_ms(recorded, 1.0) == 0.0
    report = recorded[0]
    late = [s._replace(ready=s.ready + 0.5 * s.stage, start=s.start + 0.5 * s.stage,
                       end=s.end + 0.5 * s.stage)  # each activation arrives 0.5 later
            if s.kind is aioready.tasks.Kind.F else s for s in report.spans]
    report.spans[:] = late
    assert message_latency_ms([report], 1.0) == pytest.approx(0.5)


def test_cli_writes_table_json_and_chart(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    recorded = _run([L] * S, steps=1)
    spans = write_csv(recorded, tmp_path / "spans.csv")
    out = tmp_path / "advice.json"
    png = tmp_path / "advice.png"
    # the CSV's clock is taken as seconds: the virtual clock's ms read as s scale every row alike
    assert main(["advise", str(spans), "--layers-per-stage", "4,4,4,4", "--json", str(out),
                 "--png", str(png)]) == 0
    text = capsys.readouterr().out
    assert "advice: move 1 layer from stage 1" in text and "aioready.split(model" in text
    body = json.loads(out.read_text())
    assert body["best"]["kind"] == "layers" and body["options"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a Chrome trace and Parquet of the same run give the same advice
    for path in (write_chrome_trace(recorded, tmp_path / "t.json"),
                 write_parquet(recorded, tmp_path / "t.parquet")):
        assert main(["advise", str(path), "--layers-per-stage", "4"]) == 0
        assert "advice: move 1 layer from stage 1" in capsys.readouterr().out


def test_a_latency_seen_in_the_spans_is_replayed_and_halved() -> None:
    report = _run([L] * S, steps=1)[0]
    report.spans[:] = [s._replace(ready=s.ready + 0.5 * s.stage, start=s.start + 0.5 * s.stage,
                                  end=s.end + 0.5 * s.stage)
                       if s.kind is aioready.tasks.Kind.F else s for s in report.spans]
    advice = advise(Recording((report,), unit_ms=1.0))
    assert advice.latency_ms == pytest.approx(0.5)
    halved = [o for o in advice.options if o.kind == "latency"]
    assert len(halved) == 1 and halved[0].change == {"latency_ms": pytest.approx(0.25)}
    assert halved[0].step_time < advice.now.step_time  # every message on the path is faster


def test_train_json_summary_is_enough_to_advise(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    summary = tmp_path / "run.json"
    assert main(["train", "--stages", "2", "--microbatches", "4", "--steps", "2", "--sleep-only",
                 "--task-ms", "2", "--no-progress", "--hint", "1f1b", "--json", str(summary)]
                ) == 0  # advice on a 1F1B run
    body = json.loads(summary.read_text())
    assert body["layers_per_stage"] == 1 and len(body["spans"]["rows"]) == 2 * 2 * 4 * 2
    capsys.readouterr()
    assert main(["advise", str(summary)]) == 0
    text = capsys.readouterr().out
    assert "now: 1f1b ready" in text and "microbatches 4 -> 8" in text
